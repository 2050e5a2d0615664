//! PROXY protocol v2 on the packet path, with real packets through the real programs (`BPF_PROG_TEST_RUN`): the
//! header's exact bytes in front of the client's first bytes, the sequence and acknowledgement translation both
//! ways, the SYN's SACK-permitted (at an odd offset too) and the SYN-ACK's MSS, checksums, the header again while
//! the backend has not acknowledged it and never after. XDP inserts; TC refuses the service's connections, counted.
//! Needs root.

mod common;
use common::*;

use lb_common::{proxy, stat, FLOW_F_PROXY_ACKED};

const SPORT: u16 = 40000;
/// The client's and the backend's initial sequence numbers.
const ISN: u32 = 5000;
const BISN: u32 = 90_000;

/// The header the backend must get from the test's client.
fn expected_header<F: Fam>() -> Vec<u8> {
    let ip_bytes = |a: std::net::IpAddr| match a {
        std::net::IpAddr::V4(a) => a.octets().to_vec(),
        std::net::IpAddr::V6(a) => a.octets().to_vec(),
    };
    let (fam, addrs) = if F::vip().is_ipv4() {
        (0x11, 12u16)
    } else {
        (0x21, 36)
    };
    let mut h = vec![
        0x0d, 0x0a, 0x0d, 0x0a, 0x00, 0x0d, 0x0a, 0x51, 0x55, 0x49, 0x54, 0x0a, 0x21, fam,
    ];
    h.extend(addrs.to_be_bytes());
    h.extend(ip_bytes(F::client()));
    h.extend(ip_bytes(F::vip()));
    h.extend(SPORT.to_be_bytes());
    h.extend(WEB_PORT.to_be_bytes());
    h
}

/// A client segment with explicit numbers and options.
fn client<F: Fam>(flags: Flags, seq: u32, ack: u32, options: &[u8], payload: &[u8]) -> Vec<u8> {
    tcp_opts(
        CLIENT_MAC,
        LB_MAC,
        (F::client(), SPORT),
        (F::vip(), WEB_PORT),
        flags,
        (seq, ack),
        options,
        payload,
    )
}

/// The backend's segment on the connection whose forwarded SYN was `syn`.
fn backend(syn: &Parsed, flags: Flags, seq: u32, ack: u32, options: &[u8]) -> Vec<u8> {
    tcp_opts(
        syn.dst_mac,
        LB_MAC,
        (syn.dst, syn.dport),
        (syn.src, syn.sport),
        flags,
        (seq, ack),
        options,
        b"",
    )
}

/// The TCP options of a frame.
fn options_of(frame: &[u8]) -> Vec<u8> {
    let l4 = if frame[12..14] == [0x86, 0xdd] {
        54
    } else {
        14 + ((frame[14] & 0x0f) as usize) * 4
    };
    let doff = (frame[l4 + 12] >> 4) as usize * 4;
    frame[l4 + 20..l4 + doff].to_vec()
}

fn run_ok<F: Fam>(h: &mut Harness<F>, frame: &[u8]) -> (Parsed, Vec<u8>) {
    let (v, out) = h.run(frame);
    assert_eq!(v, Verdict::Tx);
    let p = parse(&out);
    assert!(p.ip_csum_ok && p.l4_csum_ok, "checksums of {p:?}");
    (p, out)
}

fn proxy_service<F: Fam>(h: &Harness<F>) -> lb_agent::dataplane::model::ServiceSpec {
    let mut s = h.web(&[1]);
    s.proxy_v2 = true;
    s
}

both_families! {
    fn the_header_goes_in_front_of_the_clients_first_bytes_until_the_backend_acknowledges_it(h) {
        h.apply(&[proxy_service(h)]);
        let n = if F::vip().is_ipv4() { proxy::HEADER_LEN_V4 } else { proxy::HEADER_LEN_V6 } as u32;
        if h.hook == Hook::Tc {
            let (v, _) = h.run(&client::<F>(SYN, ISN, 0, &[], b""));
            assert_eq!(v, Verdict::Drop, "TC cannot insert: the connection is refused");
            assert_eq!(h.stat(stat::DROP_PROXY), 1);
            return;
        }
        // The client's SYN (Linux's options) loses SACK-permitted (SACK is off on PROXY connections), nothing else;
        // it is not shifted.
        let ts = [8u8, 10, 0, 0, 0, 7, 0, 0, 0, 9];
        let linux = [&[2u8, 4, 0x05, 0xb4, 4, 2][..], &ts, &[1, 3, 3, 7]].concat();
        let no_sack = [&[2u8, 4, 0x05, 0xb4, 1, 1][..], &ts, &[1, 3, 3, 7]].concat();
        let (syn, out) = run_ok(h, &client::<F>(SYN, ISN, 0, &linux, b""));
        assert_eq!(syn.seq, ISN, "the SYN is not shifted");
        assert_eq!(options_of(&out), no_sack);
        // Retransmitted, with the option at an odd offset (the checksum takes its bytes in the other halves of
        // its words).
        let odd = [&[1u8, 2, 4, 0x05, 0xb4, 4, 2][..], &ts, &[1, 0, 0]].concat();
        let (_, out) = run_ok(h, &client::<F>(SYN, ISN, 0, &odd, b""));
        assert_eq!(options_of(&out), [&[1u8, 2, 4, 0x05, 0xb4, 1, 1][..], &ts, &[1, 0, 0]].concat());

        // The SYN-ACK's MSS goes down by the header's length; its ACK (the stream's start) is unchanged.
        let syn_ack = [&[2u8, 4, 0x05, 0xb4, 1, 1][..], &ts, &[1, 3, 3, 7]].concat();
        let (sa, out) = run_ok(h, &backend(&syn, SYN_ACK, BISN, ISN + 1, &syn_ack));
        assert_eq!(sa.ack, ISN + 1);
        let mss = (1460 - n as u16).to_be_bytes();
        assert_eq!(options_of(&out), [&[2u8, 4, mss[0], mss[1], 1, 1][..], &ts, &[1, 3, 3, 7]].concat());

        // The handshake's ACK carries the header; its sequence number is the stream's start.
        let header = expected_header::<F>();
        let (a, _) = run_ok(h, &client::<F>(ACK, ISN + 1, BISN + 1, &[], b""));
        assert_eq!((a.seq, a.ack), (ISN + 1, BISN + 1));
        assert_eq!(a.payload, header, "the exact PROXY v2 header");
        assert_eq!(h.stat(stat::PROXY_HEADERS), 1);

        // The SYN-ACK again (the ACK was lost on the way to the backend): the client's next ACK carries the header
        // again. (The connection is established here, so its options pass as they are: a client past its handshake
        // reads neither.)
        let (sa2, out) = run_ok(h, &backend(&syn, SYN_ACK, BISN, ISN + 1, &syn_ack));
        assert_eq!(sa2.ack, ISN + 1);
        assert_eq!(options_of(&out), syn_ack);
        let (a2, _) = run_ok(h, &client::<F>(ACK, ISN + 1, BISN + 1, &[], b""));
        assert_eq!(a2.payload, header);

        // The first data before the backend acknowledged the header: header in front again (a duplicate for a
        // backend that has it), then the bytes.
        let (d, _) = run_ok(h, &client::<F>(ACK, ISN + 1, BISN + 1, &[], b"hello"));
        assert_eq!(d.seq, ISN + 1);
        assert_eq!(d.payload, [&header[..], b"hello"].concat());
        assert_eq!(h.stat(stat::PROXY_HEADERS), 3);

        // An acknowledgement inside the header: the client has nothing acknowledged yet.
        let (r, _) = run_ok(h, &backend(&syn, ACK, BISN + 1, ISN + 1 + 10, &[]));
        assert_eq!(r.ack, ISN + 1);
        // The backend acknowledges header and data: back by the header's length, and both entries know.
        let (r, _) = run_ok(h, &backend(&syn, ACK, BISN + 1, ISN + 1 + n + 5, &[]));
        assert_eq!(r.ack, ISN + 6);
        let fwd = h.flows().get(&h.key(SPORT, 6, WEB_PORT)).unwrap().unwrap();
        assert_ne!(fwd.flags & FLOW_F_PROXY_ACKED, 0);
        let rev = h.flows().get(&fwd.partner_key(6)).unwrap().unwrap();
        assert_ne!(rev.flags & FLOW_F_PROXY_ACKED, 0);

        // From now on only the shift: new data, and a retransmission of the first bytes.
        let (d, _) = run_ok(h, &client::<F>(ACK, ISN + 6, BISN + 1, &[], b"world"));
        assert_eq!((d.seq, d.payload.as_slice()), (ISN + 6 + n, &b"world"[..]));
        let (d, _) = run_ok(h, &client::<F>(ACK, ISN + 1, BISN + 1, &[], b"hello"));
        assert_eq!((d.seq, d.payload.as_slice()), (ISN + 1 + n, &b"hello"[..]));
        assert_eq!(h.stat(stat::PROXY_HEADERS), 3);

        // SACK is off for the connection (see the SYN above): options of other segments pass as they are.
        let edges = |a: u32, b: u32| [a.to_be_bytes(), b.to_be_bytes()].concat();
        let sack = [&[1u8, 1, 5, 10][..], &edges(ISN + 1 + n + 100, ISN + 1 + n + 200)].concat();
        let (r, out) = run_ok(h, &backend(&syn, ACK, BISN + 1, ISN + 1 + n + 10, &sack));
        assert_eq!(r.ack, ISN + 11);
        assert_eq!(options_of(&out), sack);

        // The client's FIN and the backend's FIN-ACK close it, translated to the end.
        let (f, _) = run_ok(h, &client::<F>(FIN_ACK, ISN + 11, BISN + 1, &[], b""));
        assert_eq!(f.seq, ISN + 11 + n);
        let (f, _) = run_ok(h, &backend(&syn, FIN_ACK, BISN + 1, ISN + 12 + n, &[]));
        assert_eq!(f.ack, ISN + 12);
        let (l, _) = run_ok(h, &client::<F>(ACK, ISN + 12, BISN + 2, &[], b""));
        assert_eq!(l.seq, ISN + 12 + n);
    }

    /// A client that reuses its port right after a PROXY connection closed (TIME_WAIT reuse, as Linux clients with
    /// `tcp_tw_reuse` do) opens a connection of its own, with none of the closed one's translation: SACK off again,
    /// its numbers unshifted, the backend's SYN-ACK acknowledged exactly, the header in front of its first bytes.
    fn a_reused_client_port_after_the_close_is_a_new_proxy_connection(h) {
        if h.hook == Hook::Tc {
            // TC refuses PROXY connections (above).
            return;
        }
        h.apply(&[proxy_service(h)]);
        let n = if F::vip().is_ipv4() { proxy::HEADER_LEN_V4 } else { proxy::HEADER_LEN_V6 } as u32;
        let sack_ok = [2u8, 4, 0x05, 0xb4, 4, 2];
        let (syn, _) = run_ok(h, &client::<F>(SYN, ISN, 0, &sack_ok, b""));
        run_ok(h, &backend(&syn, SYN_ACK, BISN, ISN + 1, &[2, 4, 0x05, 0xb4]));
        run_ok(h, &client::<F>(ACK, ISN + 1, BISN + 1, &[], b"hello"));
        run_ok(h, &backend(&syn, ACK, BISN + 1, ISN + 6 + n, &[]));
        run_ok(h, &client::<F>(FIN_ACK, ISN + 6, BISN + 1, &[], b""));
        run_ok(h, &backend(&syn, FIN_ACK, BISN + 1, ISN + 7 + n, &[]));
        run_ok(h, &client::<F>(ACK, ISN + 7, BISN + 2, &[], b""));
        // The same port again, a new ISN.
        let isn2 = ISN + 1_000_000;
        let (syn2, out) = run_ok(h, &client::<F>(SYN, isn2, 0, &sack_ok, b""));
        assert_eq!(syn2.seq, isn2, "the new SYN is not shifted");
        assert_eq!(options_of(&out), [2u8, 4, 0x05, 0xb4, 1, 1, 0, 0], "SACK is off on the new connection");
        let (sa, _) = run_ok(h, &backend(&syn2, SYN_ACK, BISN + 7, isn2 + 1, &[2, 4, 0x05, 0xb4]));
        assert_eq!(sa.ack, isn2 + 1);
        let (a, _) = run_ok(h, &client::<F>(ACK, isn2 + 1, BISN + 8, &[], b""));
        assert_eq!(a.payload, expected_header::<F>());
    }

    fn a_service_without_proxy_keeps_its_numbers(h) {
        h.apply(&[h.web(&[1])]);
        let (syn, _) = run_ok(h, &client::<F>(SYN, ISN, 0, &[2, 4, 0x05, 0xb4], b""));
        let (_, out) = run_ok(h, &backend(&syn, SYN_ACK, BISN, ISN + 1, &[2, 4, 0x05, 0xb4]));
        assert_eq!(options_of(&out), [2, 4, 0x05, 0xb4]);
        let (a, _) = run_ok(h, &client::<F>(ACK, ISN + 1, BISN + 1, &[], b"hi"));
        assert_eq!((a.seq, a.payload.as_slice()), (ISN + 1, &b"hi"[..]));
        let (r, _) = run_ok(h, &backend(&syn, ACK, BISN + 1, ISN + 3, &[]));
        assert_eq!(r.ack, ISN + 3);
        assert_eq!(h.stat(stat::PROXY_HEADERS), 0);
    }
}

per_family! {
    /// HA: a PROXY connection synced to a peer (through the flow store, as the sync applies it) is translated there
    /// exactly as on its origin, and the peer, not knowing whether the backend has the header, puts it in once more
    /// at the stream's start: the same bytes at the same place.
    fn a_synced_proxy_connection_is_translated_by_the_peer() {
        use lb_agent::ha::flowstore::BpfFlowStore;
        use lb_agent::ha::sync::FlowRecord;
        use std::sync::atomic::AtomicBool;
        use std::sync::Arc;

        let n = if F::vip().is_ipv4() { proxy::HEADER_LEN_V4 } else { proxy::HEADER_LEN_V6 } as u32;
        let mut a = Harness::<F>::open(Hook::Xdp);
        let mut b = Harness::<F>::open(Hook::Xdp);
        a.apply(&[proxy_service(&a)]);
        b.apply(&[proxy_service(&b)]);
        let mut store = BpfFlowStore::open(&b.dp.maps, Arc::new(AtomicBool::new(false))).unwrap();
        let cfg = lb_common::Config {
            flags: lb_common::CFG_F_SYNC_EVENTS,
            ..Default::default()
        };
        a.dp.maps.config.set(lb_common::CONFIG_INDEX, &cfg).unwrap();
        let mut events = a.dp.maps.take_flow_events::<F::A>().unwrap();

        let (syn, _) = run_ok(&mut a, &client::<F>(SYN, ISN, 0, &[], b""));
        run_ok(&mut a, &backend(&syn, SYN_ACK, BISN, ISN + 1, &[]));
        let (on_a, _) = run_ok(&mut a, &client::<F>(ACK, ISN + 1, BISN + 1, &[], b""));
        assert_eq!(on_a.payload, expected_header::<F>());
        let item = events.next().expect("the new connection is published");
        // SAFETY: the data plane writes whole events of this family to the ring.
        let ev: lb_common::FlowEvent<F::A> =
            unsafe { std::ptr::read_unaligned(item.as_ptr().cast()) };
        drop(item);
        assert_eq!((ev.fwd.proxy_len as u32, ev.rev.proxy_len as u32), (n, n));
        store
            .apply_batch(&[FlowRecord {
                event: F::sync_event(ev),
                age_ms: 0,
            }])
            .unwrap();

        // The client's first data, after a failover: on B the header goes in front again (B has no
        // acknowledgement of it), at the same sequence numbers as on A.
        let (d, _) = run_ok(&mut b, &client::<F>(ACK, ISN + 1, BISN + 1, &[], b"hello"));
        assert_eq!((d.seq, d.payload.clone()), (ISN + 1, [&expected_header::<F>()[..], b"hello"].concat()));
        // The backend's acknowledgement through B, and B's next client segment only shifted.
        let (r, _) = run_ok(&mut b, &backend(&syn, ACK, BISN + 1, ISN + 1 + n + 5, &[]));
        assert_eq!(r.ack, ISN + 6);
        let (d, _) = run_ok(&mut b, &client::<F>(ACK, ISN + 6, BISN + 1, &[], b"world"));
        assert_eq!((d.seq, d.payload.as_slice()), (ISN + 6 + n, &b"world"[..]));
    }
}
