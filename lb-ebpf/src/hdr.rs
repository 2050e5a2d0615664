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
