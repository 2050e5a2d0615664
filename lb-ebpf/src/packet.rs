//! The parsed packet passed down the path (Katran's `packet_description`): its headers, its 5-tuple, its flags.

use lb_common::{FlowKey, FlowKeyV4, PROTO_TCP};

use crate::{family::Family, hdr::*};

/// A TCP or UDP packet, parsed once: the headers it is rewritten through and what the flow rules read. Kept
/// small: it lives on the BPF stack for the whole path (older kernels' verifiers refuse a program whose call
/// frames add up to more than 512 bytes; the build checks the main frame against 448).
pub struct L4Pkt<F: Family> {
    /// Start of the frame (Ethernet header).
    pub eth: *mut EthHdr,
    pub ip: *mut F::Ip,
    /// The L4 header's ports (TCP or UDP).
    pub ports: *mut Ports,
    /// TCP sequence and acknowledgement numbers as on the wire (0 for UDP). Values, not a pointer to the TCP
    /// header that is null for UDP: with a nullable pointer read on TCP-only paths, kernel 6.1's verifier followed
    /// the UDP path into the read ("invalid mem access 'scalar'"), as it cannot tie the protocol to the pointer.
    pub seq_be: u32,
    pub ack_be: u32,
    /// The 5-tuple as it arrived.
    pub key: FlowKey<F::A>,
    /// IP total length (IPv6: fixed header + payload length).
    pub tot: u16,
    /// TCP flags (0 for UDP).
    pub tcp_flags: u8,
}

impl<F: Family> L4Pkt<F> {
    /// The packet of headers `eth`, `ip` and `ports` (the L4 header), 5-tuple `key` and IP total length `tot`;
    /// `tcp` is the TCP header (the same address as `ports`), null for UDP.
    ///
    /// # Safety
    /// The pointers must have been bounds-checked for their types.
    #[inline(always)]
    pub unsafe fn new(
        eth: *mut EthHdr,
        ip: *mut F::Ip,
        ports: *mut Ports,
        tcp: *mut TcpHdr,
        key: FlowKey<F::A>,
        tot: u16,
    ) -> Self {
        let (tcp_flags, seq_be, ack_be) = if tcp.is_null() {
            (0, 0, 0)
        } else {
            // SAFETY: as the function's.
            unsafe { ((*tcp).flags, (*tcp).seq, (*tcp).ack) }
        };
        L4Pkt {
            eth,
            ip,
            ports,
            seq_be,
            ack_be,
            key,
            tot,
            tcp_flags,
        }
    }

    #[inline(always)]
    pub fn is_tcp(&self) -> bool {
        self.key.proto == PROTO_TCP
    }

    /// TCP sequence number as on the wire (0 for UDP).
    #[inline(always)]
    pub fn seq_be(&self) -> u32 {
        self.seq_be
    }

    /// TCP acknowledgement number as on the wire (0 for UDP).
    #[inline(always)]
    pub fn ack_be(&self) -> u32 {
        self.ack_be
    }

    /// The L4 checksum field and its offset in the frame (TC's helpers take the offset).
    #[inline(always)]
    pub fn csum(&self) -> (*mut u16, usize) {
        let off = if self.is_tcp() {
            TCP_CSUM_OFF
        } else {
            UDP_CSUM_OFF
        };
        let at = self.ports as usize + off;
        (at as *mut u16, at - self.eth as usize)
    }

    /// A TCP SYN without ACK: the only segment that starts a connection.
    #[inline(always)]
    pub fn syn(&self) -> bool {
        self.is_tcp() && self.tcp_flags & (TCP_SYN | TCP_ACK) == TCP_SYN
    }
}

#[inline(always)]
pub(crate) fn flow_key(ip: *mut Ipv4Hdr, ports: *mut Ports, proto: u8) -> FlowKeyV4 {
    // SAFETY: both pointers were bounds-checked by the caller.
    unsafe {
        FlowKeyV4 {
            src: (*ip).src,
            dst: (*ip).dst,
            sport: (*ports).sport,
            dport: (*ports).dport,
            proto,
            _pad: [0; 3],
        }
    }
}
