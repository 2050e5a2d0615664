//! The rules only IPv6 has, and the IPv6 forms of IPv4's header rules, proven as `dataplane.rs` proves the rest
//! (which runs each family-independent rule in both families): real IPv6 frames through the real programs (the
//! IPv4 entry points tail-call them) via BPF_PROG_TEST_RUN, both hooks. Needs root.

mod common;
use common::*;

use lb_common::stat;
use std::net::{IpAddr, Ipv6Addr};

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

both_hooks! { ipv6:
    fn udp_without_checksum_is_dropped_and_counted(h) {
        h.apply(&[h.dns(&[1])]);
        let mut f = h.client_udp(5353, b"query");
        // The UDP checksum: Ethernet 14 + IPv6 40 + 6.
        f[60] = 0;
        f[61] = 0;
        let (v, _) = h.run(&f);
        assert_eq!(v, Verdict::Drop);
        assert_eq!(h.stat(stat::DROP_UDP6_NO_CHECKSUM), 1);
    }

    fn a_stray_segment_without_a_flow_is_dropped(h) {
        h.apply(&[h.web(&[1])]);
        let (v, _) = h.run(&h.client_tcp(40002, ACK, b"x"));
        assert_eq!(v, Verdict::Drop);
        assert_eq!(h.stat(stat::DROP_NO_FLOW), 1);
    }

    fn traffic_for_no_service_goes_to_the_kernel_untouched(h) {
        h.apply(&[h.web(&[1]), h.dns(&[1])]);
        let ssh = tcp(CLIENT_MAC, LB_MAC, CLIENT6, 40003, VIP6, 22, SYN, b"");
        let other_udp = udp(CLIENT_MAC, LB_MAC, CLIENT6, 50000, VIP6, 5000, b"x");
        let other: Ipv6Addr = "2001:db8:113::9".parse().unwrap();
        let to_other_ip = tcp(CLIENT_MAC, LB_MAC, CLIENT6, 50000, other, WEB_PORT, SYN, b"");
        // VRRPv3 to its IPv6 group (keepalived on this machine), and a protocol we do not know.
        let vrrp = ipv6_frame(112, CLIENT6, "ff02::12".parse().unwrap(), &[0x31, 1, 100, 1, 0, 20, 0, 0]);
        let unknown = ipv6_frame(253, CLIENT6, VIP6, b"proto 253");
        for (name, f) in [
            ("ssh to the VM", &ssh),
            ("other UDP port", &other_udp),
            ("other address", &to_other_ip),
            ("vrrp", &vrrp),
            ("unknown protocol", &unknown),
        ] {
            let (v, out) = h.run(f);
            assert_eq!(v, Verdict::Pass, "{name}");
            assert_eq!(&out, f, "{name} must be untouched");
        }
        assert_eq!(h.stat(stat::PASS_NOT_SERVICE), 5);
        assert_eq!(h.stat(stat::NEW_FLOWS), 0);
    }

    fn neighbour_discovery_goes_to_the_kernel_uncounted_as_malformed(h) {
        h.apply(&[h.web(&[1])]);
        // A neighbour solicitation (type 135) for the VIP; its checksum is the kernel's business.
        let mut ns = vec![135, 0, 0, 0, 0, 0, 0, 0];
        ns.extend_from_slice(&VIP6.octets());
        let f = ipv6_frame(58, CLIENT6, VIP6, &ns);
        assert_eq!(h.run(&f).0, Verdict::Pass);
        assert_eq!(h.stat(stat::DROP_MALFORMED), 0);
    }

    fn fragments_to_a_vip_are_dropped_others_pass(h) {
        h.apply(&[h.web(&[1])]);
        // Fragment header (next header TCP, offset 0, more fragments) and the start of a TCP header; a later
        // fragment (offset 128, no TCP header in it).
        let mut first = vec![6, 0, 0, 1, 0, 0, 0, 42];
        first.extend_from_slice(&[0; 20]);
        let mut later = vec![6, 0, 0, 0x80, 0, 0, 0, 42];
        later.extend_from_slice(&[7; 64]);
        assert_eq!(h.run(&ipv6_frame(44, CLIENT6, VIP6, &first)).0, Verdict::Drop);
        assert_eq!(h.run(&ipv6_frame(44, CLIENT6, VIP6, &later)).0, Verdict::Drop);
        let elsewhere = ipv6_frame(44, CLIENT6, "2001:db8:113::50".parse().unwrap(), &first);
        assert_eq!(h.run(&elsewhere).0, Verdict::Pass);
        assert_eq!(h.stat(stat::DROP_FRAGMENT), 2);
        assert_eq!(h.stat(stat::PASS_FRAGMENT), 1);
    }

    fn both_families_at_once(h) {
        h.apply(&[web(&[1, 2]), h.web(&[3, 4])]);
        let (v4, out4) = h.run(&client_tcp(40004, SYN, b""));
        let (v6, out6) = h.run(&h.client_tcp(40004, SYN, b""));
        assert_eq!((v4, v6), (Verdict::Tx, Verdict::Tx));
        assert!([1, 2].contains(&node_index(&parse(&out4))));
        assert!([3, 4].contains(&node_index(&parse(&out6))));
    }

    fn packet_too_big_from_a_node_reaches_the_client_translated(h) {
        h.apply(&[h.web(&[1])]);
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
        assert_eq!(h.svc_stats(&h.web(&[]).id).icmp_translated, 1);
    }

    fn an_icmpv6_error_from_the_client_side_reaches_the_backend(h) {
        h.apply(&[h.dns(&[1])]);
        let (_, out) = h.run(&h.client_udp(5380, b"q"));
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

    fn an_icmpv6_quote_ends_with_the_ip_packet_not_the_frame(h) {
        // Bytes after the IPv6 payload length (Ethernet padding) are not part of the quote: neither rewritten nor
        // summed into the ICMPv6 checksum.
        h.apply(&[h.web(&[1])]);
        let syn = open(h, 40120);
        let quoted_frame = tcp(LB_MAC, syn.dst_mac, syn.src, syn.sport, syn.dst, syn.dport, ACK, b"");
        let quoted = &quoted_frame[14..];
        // The error quotes the inner IPv6 header and ports; the rest of the segment is padding.
        let mut f = icmp_error(syn.dst_mac, LB_MAC, syn.dst, syn.src, 2, 0, 1280u32.to_be_bytes(), &quoted[..44]);
        let end = f.len();
        f.extend_from_slice(&quoted[44..]);
        let (v, out) = h.run(&f);
        assert_eq!(v, Verdict::Tx);
        let icmp = &out[54..end];
        assert_eq!(internet_checksum(&[&pseudo_header(VIP6, CLIENT6, 58, icmp.len()), icmp]), 0, "ICMPv6 checksum over the message");
        assert_eq!(&out[end..], &quoted[44..], "padding untouched");
        assert_eq!(&out[end - 44 + 8..end - 44 + 24], &CLIENT6.octets(), "quote translated");
        // With the ports in the padding, the error is about nothing known.
        let mut g = icmp_error(syn.dst_mac, LB_MAC, syn.dst, syn.src, 2, 0, 1280u32.to_be_bytes(), &quoted[..40]);
        g.extend_from_slice(&quoted[40..]);
        let (v, out) = h.run(&g);
        assert_eq!((v, &out), (Verdict::Pass, &g));
        assert_eq!(h.stat(stat::PASS_ICMP_UNKNOWN), 1);
        // An ICMPv6 header cut off by the payload length is malformed, like a cut TCP or UDP header.
        let mut cut = g.clone();
        cut[18..20].copy_from_slice(&4u16.to_be_bytes());
        assert_eq!(h.run(&cut).0, Verdict::Drop);
        assert_eq!(h.stat(stat::DROP_MALFORMED), 1);
    }

    fn icmpv6_errors_about_other_traffic_pass(h) {
        h.apply(&[h.web(&[1])]);
        let quoted = tcp(LB_MAC, CLIENT_MAC, VIP6, 22, CLIENT6, 50000, ACK, b"");
        let f = icmp_error(CLIENT_MAC, LB_MAC, CLIENT6, VIP6, 1, 4, [0; 4], &quoted[14..]);
        let (v, out) = h.run(&f);
        assert_eq!((v, &out), (Verdict::Pass, &f));
        assert_eq!(h.stat(stat::PASS_ICMP_UNKNOWN), 1);
    }

    fn echo_to_the_vip_goes_to_the_kernel(h) {
        h.apply(&[h.web(&[1])]);
        let f = icmp_error(CLIENT_MAC, LB_MAC, CLIENT6, VIP6, 128, 0, [0, 1, 0, 1], b"ping");
        assert_eq!(h.run(&f).0, Verdict::Pass);
        assert_eq!(h.stat(stat::DROP_MALFORMED) + h.stat(stat::PASS_ICMP_UNKNOWN), 0);
    }

    fn source_ranges_with_ipv6_prefixes(h) {
        let mut s = h.web(&[1]);
        s.source_ranges = vec!["2001:db8:100::/48".parse().unwrap()];
        h.apply(&[s]);
        assert_eq!(h.run(&h.client_tcp(40200, SYN, b"")).0, Verdict::Tx, "inside the range");
        let outsider: Ipv6Addr = "2001:db8:200::10".parse().unwrap();
        let f = tcp(CLIENT_MAC, LB_MAC, outsider, 40201, VIP6, WEB_PORT, SYN, b"");
        assert_eq!(h.run(&f).0, Verdict::Drop, "outside the range");
        assert_eq!(h.stat(stat::DROP_SOURCE_RANGE), 1);
        assert_eq!(h.svc_stats(&h.web(&[]).id).drop_source_range, 1);
    }

    fn extension_headers_are_walked_and_left_untouched(h) {
        h.apply(&[h.web(&[1])]);
        let plain = h.client_tcp(40300, SYN, b"");
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
        h.apply(&[h.web(&[1]), h.dns(&[1])]);
        // Offsets: Ethernet 14, IPv6 40 (payload length at 18), TCP/UDP at 54 (TCP data offset at 66).
        let good = h.client_tcp(40400, SYN, b"");
        let mut cases: Vec<(&str, Vec<u8>)> = Vec::new();
        cases.push(("truncated IPv6 header", good[..40].to_vec()));
        let mut bad_version = good.clone();
        bad_version[14] = 0x40;
        cases.push(("version 4 in an IPv6 frame", bad_version));
        let mut long = good.clone();
        long[18..20].copy_from_slice(&400u16.to_be_bytes());
        cases.push(("payload length beyond the frame", long));
        let mut short = good.clone();
        short[18..20].copy_from_slice(&10u16.to_be_bytes());
        cases.push(("payload length cutting the TCP header", short));
        let mut cut = good[..64].to_vec();
        cut[18..20].copy_from_slice(&10u16.to_be_bytes());
        cases.push(("truncated TCP header", cut));
        let mut doff = good.clone();
        doff[66] = 0x40;
        cases.push(("TCP data offset 4", doff));
        let udp_ok = h.client_udp(5391, b"x");
        let mut udp_cut = udp_ok[..58].to_vec();
        udp_cut[18..20].copy_from_slice(&4u16.to_be_bytes());
        cases.push(("truncated UDP header", udp_cut));
        let dropped = h.run_malformed(&cases);
        assert_eq!(h.stat(stat::DROP_MALFORMED), dropped);
        assert!(h.flows().entries().unwrap().is_empty());
        // Ethernet padding after the IPv6 packet is fine.
        let mut padded = h.client_udp(5392, b"x");
        padded.extend_from_slice(&[0u8; 20]);
        assert_eq!(h.run(&padded).0, Verdict::Tx);
    }
}

/// Opens an IPv6 connection (SYN, SYN-ACK, ACK, each forwarded) and returns the forwarded SYN.
fn open(h: &mut Harness<V6>, sport: u16) -> Parsed {
    let (v, out) = h.run(&h.client_tcp(sport, SYN, b""));
    assert_eq!(v, Verdict::Tx, "SYN from port {sport} forwarded");
    let p = parse(&out);
    assert_eq!(
        h.run(&reply(&p, SYN_ACK, b"")).0,
        Verdict::Tx,
        "SYN-ACK forwarded"
    );
    assert_eq!(
        h.run(&h.client_tcp(sport, ACK, b"")).0,
        Verdict::Tx,
        "ACK forwarded"
    );
    p
}
