//! Frames for data-plane tests and benchmarks, built with etherparse, and a parser of what comes out.

use etherparse::{IpNumber, Ipv4Header, Ipv6Header, PacketBuilder, TcpHeader, UdpHeader};
use std::net::{IpAddr, Ipv4Addr};

/// MAC of the client's router (where client frames come from).
pub const CLIENT_MAC: [u8; 6] = [0x02, 0xc1, 0, 0, 0, 1];
/// MAC of the load balancer's interface.
pub const LB_MAC: [u8; 6] = [0x02, 0x1b, 0, 0, 0, 1];

/// MAC of node `i`.
pub fn node_mac(i: u8) -> [u8; 6] {
    [0x02, 0x0d, 0, 0, 0, i]
}

/// TCP flags for [`tcp`].
#[derive(Clone, Copy, Default)]
pub struct Flags {
    pub syn: bool,
    pub ack: bool,
    pub fin: bool,
    pub rst: bool,
    pub psh: bool,
}

/// A SYN.
pub const SYN: Flags = Flags {
    syn: true,
    ack: false,
    fin: false,
    rst: false,
    psh: false,
};
/// A plain ACK.
pub const ACK: Flags = Flags {
    syn: false,
    ack: true,
    fin: false,
    rst: false,
    psh: false,
};
/// SYN+ACK.
pub const SYN_ACK: Flags = Flags {
    syn: true,
    ack: true,
    fin: false,
    rst: false,
    psh: false,
};
/// FIN+ACK.
pub const FIN_ACK: Flags = Flags {
    syn: false,
    ack: true,
    fin: true,
    rst: false,
    psh: false,
};
/// RST.
pub const RST: Flags = Flags {
    syn: false,
    ack: false,
    fin: false,
    rst: true,
    psh: false,
};

/// Sequence number of every frame [`tcp`] builds; its acknowledgement number is this + 1, so a client's ACK
/// acknowledges a backend's SYN-ACK built the same way (the handshake the data plane checks).
pub const SEQ: u32 = 1000;

/// An Ethernet + IP + TCP frame with sequence number [`SEQ`] and (with ACK) acknowledgement `SEQ + 1`; IPv4 or
/// IPv6 as the addresses are.
#[allow(clippy::too_many_arguments)]
pub fn tcp(
    src_mac: [u8; 6],
    dst_mac: [u8; 6],
    src: impl Into<IpAddr>,
    sport: u16,
    dst: impl Into<IpAddr>,
    dport: u16,
    flags: Flags,
    payload: &[u8],
) -> Vec<u8> {
    tcp_seq(
        src_mac,
        dst_mac,
        (src.into(), sport),
        (dst.into(), dport),
        flags,
        (SEQ, SEQ + 1),
        payload,
    )
}

/// An Ethernet + IP + TCP frame with explicit (sequence, acknowledgement) numbers.
pub fn tcp_seq(
    src_mac: [u8; 6],
    dst_mac: [u8; 6],
    (src, sport): (impl Into<IpAddr>, u16),
    (dst, dport): (impl Into<IpAddr>, u16),
    flags: Flags,
    (seq, ack): (u32, u32),
    payload: &[u8],
) -> Vec<u8> {
    tcp_opts(
        src_mac,
        dst_mac,
        (src, sport),
        (dst, dport),
        flags,
        (seq, ack),
        &[],
        payload,
    )
}

/// [`tcp_seq`] with TCP options, as raw bytes (a multiple of 4).
#[allow(clippy::too_many_arguments)]
pub fn tcp_opts(
    src_mac: [u8; 6],
    dst_mac: [u8; 6],
    (src, sport): (impl Into<IpAddr>, u16),
    (dst, dport): (impl Into<IpAddr>, u16),
    flags: Flags,
    (seq, ack): (u32, u32),
    options: &[u8],
    payload: &[u8],
) -> Vec<u8> {
    let mut b = ip(src_mac, dst_mac, src.into(), dst.into()).tcp(sport, dport, seq, 64240);
    if !options.is_empty() {
        b = b
            .options_raw(options)
            .expect("TCP options: at most 40 bytes, a multiple of 4");
    }
    if flags.syn {
        b = b.syn();
    }
    if flags.ack {
        b = b.ack(ack);
    }
    if flags.fin {
        b = b.fin();
    }
    if flags.rst {
        b = b.rst();
    }
    if flags.psh {
        b = b.psh();
    }
    let mut out = Vec::with_capacity(b.size(payload.len()));
    b.write(&mut out, payload).unwrap();
    out
}

/// An Ethernet + IP + UDP frame; IPv4 or IPv6 as the addresses are.
pub fn udp(
    src_mac: [u8; 6],
    dst_mac: [u8; 6],
    src: impl Into<IpAddr>,
    sport: u16,
    dst: impl Into<IpAddr>,
    dport: u16,
    payload: &[u8],
) -> Vec<u8> {
    let b = ip(src_mac, dst_mac, src.into(), dst.into()).udp(sport, dport);
    let mut out = Vec::with_capacity(b.size(payload.len()));
    b.write(&mut out, payload).unwrap();
    out
}

/// The Ethernet and IP layers of a frame (hop limit 64).
fn ip(
    src_mac: [u8; 6],
    dst_mac: [u8; 6],
    src: IpAddr,
    dst: IpAddr,
) -> etherparse::PacketBuilderStep<etherparse::IpHeaders> {
    let b = PacketBuilder::ethernet2(src_mac, dst_mac);
    match (src, dst) {
        (IpAddr::V4(s), IpAddr::V4(d)) => b.ipv4(s.octets(), d.octets(), 64),
        (IpAddr::V6(s), IpAddr::V6(d)) => b.ipv6(s.octets(), d.octets(), 64),
        _ => panic!("a frame from {src} to {dst}: one family, please"),
    }
}

/// An ICMP error (type/code, `rest` = bytes 4..8 of the header, e.g. the MTU) quoting `inner` (an IP packet
/// without Ethernet header); ICMPv6, its checksum over the pseudo header, when the addresses are IPv6.
#[allow(clippy::too_many_arguments)]
pub fn icmp_error(
    src_mac: [u8; 6],
    dst_mac: [u8; 6],
    src: impl Into<IpAddr>,
    dst: impl Into<IpAddr>,
    ty: u8,
    code: u8,
    rest: [u8; 4],
    inner: &[u8],
) -> Vec<u8> {
    let (src, dst) = (src.into(), dst.into());
    let mut icmp = vec![ty, code, 0, 0, rest[0], rest[1], rest[2], rest[3]];
    icmp.extend_from_slice(inner);
    let mut out = Vec::new();
    out.extend_from_slice(&dst_mac);
    out.extend_from_slice(&src_mac);
    match (src, dst) {
        (IpAddr::V4(s), IpAddr::V4(d)) => {
            let c = internet_checksum(&[&icmp]);
            icmp[2..4].copy_from_slice(&c.to_be_bytes());
            let ip = Ipv4Header::new(
                icmp.len() as u16,
                64,
                IpNumber::ICMP,
                s.octets(),
                d.octets(),
            )
            .unwrap();
            out.extend_from_slice(&[0x08, 0x00]);
            ip.write(&mut out).unwrap();
        }
        (IpAddr::V6(s), IpAddr::V6(d)) => {
            let c = internet_checksum(&[&pseudo_header(s, d, 58, icmp.len()), &icmp]);
            icmp[2..4].copy_from_slice(&c.to_be_bytes());
            let ip = Ipv6Header {
                payload_length: icmp.len() as u16,
                next_header: IpNumber::IPV6_ICMP,
                hop_limit: 64,
                source: s.octets(),
                destination: d.octets(),
                ..Default::default()
            };
            out.extend_from_slice(&[0x86, 0xdd]);
            ip.write(&mut out).unwrap();
        }
        (s, d) => panic!("an ICMP error from {s} to {d}: one family, please"),
    }
    out.extend_from_slice(&icmp);
    out
}

/// The one's-complement Internet checksum over several slices (as if concatenated; each slice must have
/// even length except the last).
pub fn internet_checksum(parts: &[&[u8]]) -> u16 {
    let mut sum: u32 = 0;
    for p in parts {
        let mut chunks = p.chunks_exact(2);
        for c in &mut chunks {
            sum += u16::from_be_bytes([c[0], c[1]]) as u32;
        }
        if let [last] = chunks.remainder() {
            sum += (*last as u32) << 8;
        }
    }
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

/// Recomputes the IPv4 header checksum of a frame (after a test edits the header by hand).
pub fn fix_ip_checksum(frame: &mut [u8]) {
    let hl = ((frame[14] & 0x0f) as usize) * 4;
    frame[24] = 0;
    frame[25] = 0;
    let c = internet_checksum(&[&frame[14..14 + hl]]);
    frame[24..26].copy_from_slice(&c.to_be_bytes());
}

/// What a test reads back from an output frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Parsed {
    pub dst_mac: [u8; 6],
    pub src_mac: [u8; 6],
    pub src: IpAddr,
    pub dst: IpAddr,
    pub proto: u8,
    pub sport: u16,
    pub dport: u16,
    pub ip_csum_ok: bool,
    /// L4 checksum valid (for UDP with checksum 0: true).
    pub l4_csum_ok: bool,
    pub udp_csum_zero: bool,
    pub tcp_flags: u8,
    /// TCP sequence and acknowledgement numbers (0 for UDP).
    pub seq: u32,
    pub ack: u32,
    pub payload: Vec<u8>,
}

impl Parsed {
    /// The source address of an IPv4 frame.
    pub fn src4(&self) -> Ipv4Addr {
        v4(self.src)
    }

    /// The destination address of an IPv4 frame.
    pub fn dst4(&self) -> Ipv4Addr {
        v4(self.dst)
    }
}

fn v4(a: IpAddr) -> Ipv4Addr {
    match a {
        IpAddr::V4(a) => a,
        IpAddr::V6(a) => panic!("{a}: an IPv4 address was expected"),
    }
}

/// Parses an Ethernet + IPv4 or IPv6 (no extension headers) + TCP/UDP frame and verifies its checksums from
/// scratch (IPv6 has no header checksum: `ip_csum_ok` is true).
pub fn parse(frame: &[u8]) -> Parsed {
    assert!(frame.len() >= 34, "frame too short: {}", frame.len());
    let (src, dst, proto, ip_csum_ok, l4) = if frame[12..14] == [0x86, 0xdd] {
        assert!(frame.len() >= 54, "IPv6 frame too short: {}", frame.len());
        let plen = u16::from_be_bytes([frame[18], frame[19]]) as usize;
        let addr = |at: usize| IpAddr::from(<[u8; 16]>::try_from(&frame[at..at + 16]).unwrap());
        (addr(22), addr(38), frame[20], true, &frame[54..54 + plen])
    } else {
        let hl = ((frame[14] & 0x0f) as usize) * 4;
        let ip = &frame[14..14 + hl];
        let tot = u16::from_be_bytes([frame[16], frame[17]]) as usize;
        let addr =
            |at: usize| IpAddr::from(Ipv4Addr::new(ip[at], ip[at + 1], ip[at + 2], ip[at + 3]));
        (
            addr(12),
            addr(16),
            ip[9],
            internet_checksum(&[ip]) == 0,
            &frame[14 + hl..14 + tot],
        )
    };
    let pseudo = pseudo_header(src, dst, proto, l4.len());
    let (sport, dport) = (
        u16::from_be_bytes([l4[0], l4[1]]),
        u16::from_be_bytes([l4[2], l4[3]]),
    );
    let (l4_csum_ok, udp_csum_zero, tcp_flags, payload) = match proto {
        6 => {
            let h = TcpHeader::from_slice(l4).unwrap().0;
            let off = h.header_len();
            (
                internet_checksum(&[&pseudo, l4]) == 0,
                false,
                l4[13],
                l4[off..].to_vec(),
            )
        }
        17 => {
            let h = UdpHeader::from_slice(l4).unwrap().0;
            let zero = h.checksum == 0;
            (
                zero || internet_checksum(&[&pseudo, l4]) == 0,
                zero,
                0,
                l4[8..].to_vec(),
            )
        }
        _ => (true, false, 0, l4.to_vec()),
    };
    let (seq, ack) = match proto {
        6 => (
            u32::from_be_bytes(l4[4..8].try_into().unwrap()),
            u32::from_be_bytes(l4[8..12].try_into().unwrap()),
        ),
        _ => (0, 0),
    };
    Parsed {
        dst_mac: frame[0..6].try_into().unwrap(),
        src_mac: frame[6..12].try_into().unwrap(),
        src,
        dst,
        proto,
        sport,
        dport,
        ip_csum_ok,
        l4_csum_ok,
        udp_csum_zero,
        tcp_flags,
        seq,
        ack,
        payload,
    }
}

/// The IPv4 or IPv6 pseudo header for L4 checksums.
pub fn pseudo_header(
    src: impl Into<IpAddr>,
    dst: impl Into<IpAddr>,
    proto: u8,
    len: usize,
) -> Vec<u8> {
    let mut p = Vec::with_capacity(40);
    match (src.into(), dst.into()) {
        (IpAddr::V4(s), IpAddr::V4(d)) => {
            p.extend_from_slice(&s.octets());
            p.extend_from_slice(&d.octets());
            p.extend_from_slice(&[0, proto]);
            p.extend_from_slice(&(len as u16).to_be_bytes());
        }
        (IpAddr::V6(s), IpAddr::V6(d)) => {
            p.extend_from_slice(&s.octets());
            p.extend_from_slice(&d.octets());
            p.extend_from_slice(&(len as u32).to_be_bytes());
            p.extend_from_slice(&[0, 0, 0, proto]);
        }
        (s, d) => panic!("a pseudo header from {s} to {d}: one family, please"),
    }
    p
}
