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
    /// The TCP header (null for UDP): sequence and acknowledgement numbers are read only where the handshake
    /// rules need them, off the established path.
    pub tcp: *mut TcpHdr,
    /// The 5-tuple as it arrived.
    pub key: FlowKey<F::A>,
    /// IP total length (IPv6: fixed header + payload length).
    pub tot: u16,
    /// TCP flags (0 for UDP).
    pub tcp_flags: u8,
}

impl<F: Family> L4Pkt<F> {
    #[inline(always)]
    pub fn is_tcp(&self) -> bool {
        self.key.proto == PROTO_TCP
    }

    /// TCP sequence number as on the wire. Only for TCP packets.
    #[inline(always)]
    pub fn seq_be(&self) -> u32 {
        // SAFETY: `tcp` was bounds-checked when the packet was parsed and is read before any rewrite.
        unsafe { (*self.tcp).seq }
    }

    /// TCP acknowledgement number as on the wire. Only for TCP packets.
    #[inline(always)]
    pub fn ack_be(&self) -> u32 {
        // SAFETY: as for `seq_be`.
        unsafe { (*self.tcp).ack }
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
