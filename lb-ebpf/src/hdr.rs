//! Minimal on-wire header layouts. Fields stay in network byte order; only what the load balancer reads or
//! writes is named. (Hand-written rather than a crate so every field access is visible to the verifier
//! review and no dependency sits on the packet path.)

/// Ethernet header.
#[repr(C)]
pub struct EthHdr {
    /// Destination MAC.
    pub dst: [u8; 6],
    /// Source MAC.
    pub src: [u8; 6],
    /// EtherType, network order.
    pub proto: u16,
}

/// EtherType of IPv4 as loaded natively from the wire (0x0800 in network order).
pub const ETH_P_IP_BE: u16 = 0x0800u16.to_be();

/// EtherType of IPv6 as loaded natively from the wire (0x86DD in network order).
pub const ETH_P_IPV6_BE: u16 = 0x86DDu16.to_be();

/// Size of [`EthHdr`].
pub const ETH_LEN: usize = 14;

/// IPv4 header without options.
#[repr(C)]
pub struct Ipv4Hdr {
    /// Version (high nibble) and IHL (low nibble).
    pub vihl: u8,
    /// DSCP/ECN.
    pub tos: u8,
    /// Total length, network order.
    pub tot_len: u16,
    /// Identification.
    pub id: u16,
    /// Flags and fragment offset, network order.
    pub frag_off: u16,
    /// Time to live.
    pub ttl: u8,
    /// Protocol.
    pub proto: u8,
    /// Header checksum.
    pub check: u16,
    /// Source address.
    pub src: u32,
    /// Destination address.
    pub dst: u32,
}

/// Size of [`Ipv4Hdr`].
pub const IPV4_LEN: usize = 20;
/// "More fragments" bit and fragment-offset mask, host order (after `u16::from_be`).
pub const IP_MF_OFFSET_MASK: u16 = 0x3fff;

/// IPv6 fixed header.
#[repr(C)]
pub struct Ipv6Hdr {
    /// Version (high nibble of the first byte), traffic class, flow label.
    pub vtc_flow: u32,
    /// Payload length (extension headers included), network order.
    pub payload_len: u16,
    /// Next header.
    pub nexthdr: u8,
    /// Hop limit.
    pub hop_limit: u8,
    /// Source address (four network-order words).
    pub src: [u32; 4],
    /// Destination address.
    pub dst: [u32; 4],
}

/// Size of [`Ipv6Hdr`].
pub const IPV6_LEN: usize = 40;

/// An IPv6 extension header's first bytes: next header, length in 8-octet units after the first 8, and (routing
/// header) routing type and segments left.
#[repr(C)]
pub struct Ipv6ExtHdr {
    pub nexthdr: u8,
    pub len: u8,
    pub routing_type: u8,
    pub segments_left: u8,
}

/// Hop-by-hop options.
pub const IPV6_HOPOPTS: u8 = 0;
/// Routing header.
pub const IPV6_ROUTING: u8 = 43;
/// Fragment header.
pub const IPV6_FRAGMENT: u8 = 44;
/// Destination options.
pub const IPV6_DSTOPTS: u8 = 60;
/// ICMPv6 destination unreachable.
pub const ICMPV6_DEST_UNREACH: u8 = 1;
/// ICMPv6 packet too big.
pub const ICMPV6_PKT_TOOBIG: u8 = 2;
/// ICMPv6 time exceeded.
pub const ICMPV6_TIME_EXCEEDED: u8 = 3;
/// ICMPv6 echo request.
pub const ICMPV6_ECHO_REQUEST: u8 = 128;
/// ICMPv6 echo reply.
pub const ICMPV6_ECHO_REPLY: u8 = 129;
/// ICMPv6 router solicitation (first of the neighbour discovery and router messages, 133–137).
pub const ICMPV6_ND_FIRST: u8 = 133;
/// ICMPv6 redirect (last of them).
pub const ICMPV6_ND_LAST: u8 = 137;

/// The leading part of TCP and UDP headers: the ports.
#[repr(C)]
pub struct Ports {
    /// Source port.
    pub sport: u16,
    /// Destination port.
    pub dport: u16,
}

/// TCP header without options.
#[repr(C)]
pub struct TcpHdr {
    /// Source port.
    pub sport: u16,
    /// Destination port.
    pub dport: u16,
    /// Sequence number.
    pub seq: u32,
    /// Acknowledgement number.
    pub ack: u32,
    /// Data offset (high nibble) and reserved bits.
    pub doff: u8,
    /// Flags (CWR ECE URG ACK PSH RST SYN FIN).
    pub flags: u8,
    /// Window.
    pub window: u16,
    /// Checksum.
    pub check: u16,
    /// Urgent pointer.
    pub urg: u16,
}

/// Size of [`TcpHdr`].
pub const TCP_LEN: usize = 20;
/// Offset of the TCP checksum in the TCP header.
pub const TCP_CSUM_OFF: usize = 16;
/// TCP FIN flag.
pub const TCP_FIN: u8 = 0x01;
/// TCP SYN flag.
pub const TCP_SYN: u8 = 0x02;
/// TCP RST flag.
pub const TCP_RST: u8 = 0x04;
/// TCP ACK flag.
pub const TCP_ACK: u8 = 0x10;

/// UDP header.
#[repr(C)]
pub struct UdpHdr {
    /// Source port.
    pub sport: u16,
    /// Destination port.
    pub dport: u16,
    /// Length.
    pub len: u16,
    /// Checksum (0 = none).
    pub check: u16,
}

/// Size of [`UdpHdr`].
pub const UDP_LEN: usize = 8;
/// Offset of the UDP checksum in the UDP header.
pub const UDP_CSUM_OFF: usize = 6;

/// ICMP header (the 4 "rest of header" bytes included).
#[repr(C)]
pub struct IcmpHdr {
    /// Type.
    pub ty: u8,
    /// Code.
    pub code: u8,
    /// Checksum over the whole ICMP message.
    pub check: u16,
    /// Rest of header (e.g. next-hop MTU for "fragmentation needed").
    pub rest: u32,
}

/// Size of [`IcmpHdr`].
pub const ICMP_LEN: usize = 8;
/// ICMP destination unreachable (incl. fragmentation needed).
pub const ICMP_DEST_UNREACH: u8 = 3;
/// ICMP time exceeded.
pub const ICMP_TIME_EXCEEDED: u8 = 11;
