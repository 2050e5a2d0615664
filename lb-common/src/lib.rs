//! Map keys and values shared by the eBPF data plane (`lb-ebpf`) and user space (`lb-agent`).
//!
//! Everything here is `#[repr(C)]`, has explicit padding fields (the kernel hashes keys byte by byte, so
//! padding must be zeroed and therefore named), and keeps addresses and ports in network byte order exactly
//! as they appear on the wire, so the data plane never converts.
//!
//! Addresses are 16 bytes wide in every family-agnostic structure (services, backends, next hops, source
//! ranges): IPv4 lives in the first 4 bytes with `family == FAMILY_V4`. Connection tracking has one map per
//! family with a compact key, because it holds millions of entries: its types ([`FlowKey`], [`Flow`],
//! [`Transient`], [`FlowEvent`]) are written once, generic over the address as the data plane reads it from the
//! header ([`FlowAddr`]: a `u32` for IPv4, [`In6`] for IPv6), with `…V4`/`…V6` names for each.
#![no_std]

/// Bumped whenever a pinned map's key or value layout, type or flags change. The agent pins maps under a directory
/// named after it, so an upgrade with a new layout creates new maps instead of misreading old ones, and carries the
/// previous layout's state over into them (the agent's `dataplane::layouts`).
pub const LAYOUT_VERSION: u32 = 11;

/// IP protocol number of TCP.
pub const PROTO_TCP: u8 = 6;
/// IP protocol number of UDP.
pub const PROTO_UDP: u8 = 17;
/// IP protocol number of ICMP.
pub const PROTO_ICMP: u8 = 1;
/// IP protocol number (next header) of ICMPv6.
pub const PROTO_ICMPV6: u8 = 58;

/// `family` value of an IPv4 address.
pub const FAMILY_V4: u8 = 4;
/// `family` value of an IPv6 address.
pub const FAMILY_V6: u8 = 6;

/// An IPv6 address as the data plane reads it from a header: four 32-bit words of network-order bytes loaded
/// natively (so checksum deltas are computed word by word, as for IPv4's `u32`).
pub type In6 = [u32; 4];

/// The address type of a connection-tracking key: `u32` (IPv4) or [`In6`] (IPv6), network order as on the wire.
pub trait FlowAddr:
    Copy + Default + PartialEq + Eq + core::fmt::Debug + core::hash::Hash + Send + Sync + 'static
{
    /// `FAMILY_V4` or `FAMILY_V6`.
    const FAMILY: u8;
    /// The address in a family-agnostic 16-byte [`Addr`].
    fn to_addr(self) -> Addr;
    /// The address of this family held in `a` (the inverse of [`FlowAddr::to_addr`]).
    fn from_addr(a: Addr) -> Self;
    /// Folds the address into a running murmur3 hash (each 32-bit word through [`fmix`]).
    fn mix(self, h: u32) -> u32;
}

impl FlowAddr for u32 {
    const FAMILY: u8 = FAMILY_V4;
    #[inline(always)]
    fn to_addr(self) -> Addr {
        Addr::from_v4_raw(self)
    }
    #[inline(always)]
    fn from_addr(a: Addr) -> Self {
        a.v4_raw()
    }
    #[inline(always)]
    fn mix(self, h: u32) -> u32 {
        fmix(h ^ self)
    }
}

impl FlowAddr for In6 {
    const FAMILY: u8 = FAMILY_V6;
    #[inline(always)]
    fn to_addr(self) -> Addr {
        Addr::from_v6_raw(self)
    }
    #[inline(always)]
    fn from_addr(a: Addr) -> Self {
        a.v6_raw()
    }
    #[inline(always)]
    fn mix(self, h: u32) -> u32 {
        let h = fmix(h ^ self[0]);
        let h = fmix(h ^ self[1]);
        let h = fmix(h ^ self[2]);
        fmix(h ^ self[3])
    }
}

/// A 16-byte address in network byte order; IPv4 uses `bytes[0..4]` and zeroes the rest. Aligned as its words, so
/// that the BPF programs move it a word at a time; every struct holding one has it at a 4-byte offset.
#[repr(C, align(4))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Addr {
    /// The address bytes as on the wire.
    pub bytes: [u8; 16],
}

impl Addr {
    /// An IPv4 address from its on-wire (network order) `u32`, as read straight from a header.
    #[inline(always)]
    pub const fn from_v4_raw(raw_be: u32) -> Self {
        Self::from_v6_raw([raw_be, 0, 0, 0])
    }

    /// The on-wire (network order) `u32` of an IPv4 address.
    #[inline(always)]
    pub const fn v4_raw(&self) -> u32 {
        self.v6_raw()[0]
    }

    /// An IPv6 address from its four on-wire words, as read straight from a header.
    #[inline(always)]
    pub const fn from_v6_raw(w: In6) -> Self {
        // SAFETY: both are 16 plain bytes, 4-aligned; a word's memory is its on-wire bytes. (Word moves: built
        // byte by byte, the BPF programs spilled each byte.)
        unsafe { core::mem::transmute::<In6, Addr>(w) }
    }

    /// The four on-wire words of an IPv6 address.
    #[inline(always)]
    pub const fn v6_raw(&self) -> In6 {
        // SAFETY: as in `from_v6_raw`.
        unsafe { core::mem::transmute::<Addr, In6>(*self) }
    }
}

/// Key of the `SERVICES` map: one load-balanced (VIP, port, protocol).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct ServiceKey {
    /// The virtual IP.
    pub addr: Addr,
    /// Service port, network byte order.
    pub port_be: u16,
    /// `PROTO_TCP` or `PROTO_UDP`.
    pub proto: u8,
    /// `FAMILY_V4` or `FAMILY_V6`.
    pub family: u8,
}

/// The service has a non-empty source-range allow-list in `SOURCE_RANGES`.
pub const SVC_F_SOURCE_RANGES: u32 = 1 << 0;
/// TCP service whose backends get a PROXY protocol v2 header in front of each connection's byte stream (see
/// [`proxy`]).
pub const SVC_F_PROXY_V2: u32 = 1 << 1;

/// Value of the `SERVICES` map.
///
/// User space replaces the whole value to switch a service to a new backend table, so a packet sees either
/// the old table or the new one, never a mix.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Service {
    /// Dense service index: the slot in `SERVICE_STATS` and the id in `SOURCE_RANGES` keys and flows.
    pub id: u32,
    /// `SVC_F_*` bits.
    pub flags: u32,
    /// First slot of this service's Maglev table in the `MAGLEV` arena.
    pub table_offset: u32,
    /// Maglev table size (a prime), or 0 when no backend is healthy: new flows are then dropped.
    pub table_size: u32,
    /// Idle timeout of this service's flows in seconds; 0 means never expire.
    pub idle_timeout_s: u32,
    /// Reserved, zero.
    pub _pad: u32,
    /// Source address of NATed packets towards the backends (the VIP unless configured otherwise).
    pub snat_addr: Addr,
}

/// Value of the `BACKENDS` array (index = backend id, as stored in Maglev tables).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Backend {
    /// Node address.
    pub addr: Addr,
    /// NodePort, network byte order.
    pub port_be: u16,
    /// `FAMILY_V4` or `FAMILY_V6`; 0 marks an unused slot.
    pub family: u8,
    /// Reserved, zero.
    pub _pad: u8,
}

/// Value of the `NEXTHOPS` map, keyed by the backend's [`Addr`]: where to send frames for that address.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NextHop {
    /// Destination MAC (the node's, or its gateway's when the node is not on-link).
    pub mac: [u8; 6],
    /// The egress interface's slot in `EGRESS` (0: the frame leaves by the interface it came in on, as on a
    /// one-armed machine).
    pub egress: u8,
    /// Reserved, zero.
    pub _pad: u8,
    /// The egress interface's index (0 with `egress` 0). A frame that arrived on this interface leaves by it
    /// (`XDP_TX`) whatever the slot.
    pub ifindex: u32,
}

/// Slots of `EGRESS` and `EGRESS_DEVMAP`: one per interface the agent forwards on; slot 0 is never used (an
/// entry's egress 0 means "out of the interface it came in on").
pub const MAX_INTERFACES: u32 = 16;

/// Value of the `EGRESS` array: an interface a translated frame may leave by, other than the one it came in on.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Egress {
    /// Interface index (TC redirects to it; XDP redirects through `EGRESS_DEVMAP`'s same slot).
    pub ifindex: u32,
    /// The interface's MAC: the frame's new source MAC.
    pub mac: [u8; 6],
    /// Reserved, zero.
    pub _pad: u16,
}

/// Data of an `SOURCE_RANGES` LPM-trie key. The prefix length counts the 32 bits of `svc_id` plus the
/// CIDR's own prefix, so one trie serves every service.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SourceRangeKey {
    /// Service id, big endian so it forms the leading, always-matched part of the prefix.
    pub svc_id_be: u32,
    /// Client address.
    pub addr: Addr,
}

/// Bits of the LPM prefix taken by [`SourceRangeKey::svc_id_be`].
pub const SOURCE_RANGE_ID_BITS: u32 = 32;

/// Key of a connection-tracking map: a packet's 5-tuple as it arrives (16 bytes for IPv4, 40 for IPv6).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct FlowKey<A> {
    /// Source address (network order).
    pub src: A,
    /// Destination address (network order).
    pub dst: A,
    /// Source port (network order).
    pub sport: u16,
    /// Destination port (network order).
    pub dport: u16,
    /// IP protocol.
    pub proto: u8,
    /// Reserved, zero.
    pub _pad: [u8; 3],
}

/// The entry was created for the client → VIP direction.
pub const FLOW_F_FORWARD: u8 = 1 << 0;
/// The entry was created for the backend → SNAT direction.
pub const FLOW_F_REVERSE: u8 = 1 << 1;
/// A FIN was seen in this entry's direction.
pub const FLOW_F_FIN: u8 = 1 << 2;
/// A RST was seen in this entry's direction.
pub const FLOW_F_RST: u8 = 1 << 3;
/// The entry was written by connection-state sync from a peer and has not carried a packet here since (the data
/// plane clears the bit when it refreshes `last_seen_ns`), so the periodic refresh does not echo it back.
pub const FLOW_F_SYNCED: u8 = 1 << 4;

/// Reverse entry of a TCP handshake in `TRANSIENT_V4`: the backend's SYN-ACK passed, and
/// [`TransientV4::ack_be`] holds the acknowledgement number the client's ACK must carry.
pub const FLOW_F_SYN_ACK: u8 = 1 << 5;

/// Forward entry of a TCP connection the agent ended (its backend failed its checks or left the service, and is
/// not draining): once the backend is silent on it ([`END_SILENCE_NS`]), the client's next segment is answered
/// with a RST, and the connection closes as if the client had reset it.
pub const FLOW_F_END: u8 = 1 << 6;

/// Entry of a PROXY v2 connection whose backend acknowledged the header: the client's segments no longer get it.
/// Set on both entries by the backend's first acknowledgement past the header; a peer's copy without it only makes
/// the header go again at the same sequence number, which the backend takes as a duplicate.
pub const FLOW_F_PROXY_ACKED: u8 = 1 << 7;

/// How long the backend of an ended connection must have sent nothing on it before the client gets the reset
/// (ns). Until then the backend still answers — a health check failing under load, a backend removed while it
/// serves — and the connection goes on: the reset replaces silence, never a working exchange. The reverse
/// entry's timestamp moves once a second, so the silence seen is 2–3 s.
pub const END_SILENCE_NS: u64 = 2_000_000_000;

/// Idle timeout of a TCP flow once FIN or RST was seen (seconds): long enough for the last ACKs and
/// retransmissions — a peer whose retransmission timeout has backed off (Linux starts at 3 s after a lost
/// handshake segment and doubles it) sends its FIN again after 20 s and more; a connection forgotten before that
/// leaves the client waiting for a FIN the load balancer's kernel answers with a RST (Linux's conntrack keeps
/// LAST_ACK 30 s, TIME_WAIT 120 s). Closed connections live in the handshake table, whose LRU recycles the oldest
/// first when it is full, so under a high connection rate they give their SNAT ports back sooner.
pub const TCP_CLOSING_TIMEOUT_S: u32 = 60;

/// How long a TCP handshake may stay incomplete (seconds): covers a client's SYN retransmissions at 1, 3, 7 and
/// 15 s; after that a SYN from the same port starts over.
pub const TCP_HANDSHAKE_TIMEOUT_S: u32 = 30;

/// Key of `FLOWS_V4` and `TRANSIENT_V4`.
pub type FlowKeyV4 = FlowKey<u32>;
/// Key of `FLOWS_V6` and `TRANSIENT_V6`.
pub type FlowKeyV6 = FlowKey<In6>;

/// Value of a connection-tracking map: how to rewrite a packet whose 5-tuple is the key (48 bytes for IPv4, 72
/// for IPv6; no implicit padding in either).
///
/// A full-NAT flow has two entries: the forward one keyed by (client, VIP, cport, vport) rewriting to
/// (SNAT, node, sport, nodeport), and the reverse one keyed by (node, SNAT, nodeport, sport) rewriting to
/// (VIP, client, vport, cport). Each entry's partner key is its rewritten tuple turned around, so it is not
/// stored.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Flow<A> {
    /// New source address.
    pub new_src: A,
    /// New destination address.
    pub new_dst: A,
    /// New source port.
    pub new_sport: u16,
    /// New destination port.
    pub new_dport: u16,
    /// Destination MAC of the rewritten frame (backend next hop, or the client-side MAC the flow came from).
    pub mac: [u8; 6],
    /// `FLOW_F_*` bits.
    pub flags: u8,
    /// Slot in `EGRESS` of the interface the rewritten frame leaves by; 0: the one it came in on (`XDP_TX`).
    pub egress: u8,
    /// Service id (for counters).
    pub svc_id: u32,
    /// Backend id.
    pub backend_id: u32,
    /// Idle timeout in seconds; 0 = never.
    pub timeout_s: u32,
    /// One's-complement sum that turns the old addresses into the new ones (IPv4 header and L4 pseudo header).
    pub csum_addr: u32,
    /// One's-complement sum that turns the old ports into the new ones (L4 header only).
    pub csum_port: u32,
    /// A PROXY v2 connection (`proxy_len` ≠ 0): the client's sequence number where the header goes in (one past
    /// its SYN's), network order. Both entries hold it: the client's segments are shifted after it, the backend's
    /// acknowledgements back (see [`proxy`]).
    pub proxy_seq_be: u32,
    /// Length of the PROXY v2 header this connection's backend gets ([`proxy::HEADER_LEN_V4`] or
    /// [`proxy::HEADER_LEN_V6`]); 0: none.
    pub proxy_len: u16,
    /// Reserved, zero.
    pub _pad: u16,
    /// Last time a packet used this entry, `bpf_ktime_get_coarse_ns` clock (CLOCK_MONOTONIC_COARSE), ns.
    pub last_seen_ns: u64,
}

/// Value of `FLOWS_V4`.
pub type FlowV4 = Flow<u32>;
/// Value of `FLOWS_V6`.
pub type FlowV6 = Flow<In6>;

impl<A: FlowAddr> Flow<A> {
    /// Whether the entry has been idle past its timeout at `now` (0 = never). A connection is idle only when both
    /// of its entries are; the data plane and the agent's GC both apply this rule.
    #[inline(always)]
    pub fn idle(&self, now_ns: u64) -> bool {
        self.timeout_s != 0
            && now_ns.saturating_sub(self.last_seen_ns) > self.timeout_s as u64 * 1_000_000_000
    }

    /// Whether the connection is idle at `now`: this entry and its partner (looked up only when this one is
    /// idle) both idle past their timeouts — a one-way stream keeps its connection alive through either entry —
    /// or this one idle and the partner gone (evicted, or replaced). The data plane then ignores the connection and
    /// the agent's GC deletes it.
    #[inline(always)]
    pub fn connection_idle<'a>(
        &self,
        now_ns: u64,
        partner: impl FnOnce() -> Option<&'a Flow<A>>,
    ) -> bool
    where
        A: 'a,
    {
        self.idle(now_ns) && partner().is_none_or(|p| p.idle(now_ns))
    }

    /// Records FIN or RST (`bits`, `FLOW_F_*`) seen at `now`: a closing direction lives at most
    /// [`TCP_CLOSING_TIMEOUT_S`] longer. The data plane applies it to the packets it sees, the flow sync to the
    /// closes a peer saw.
    #[inline(always)]
    pub fn close(&mut self, bits: u8, now_ns: u64) {
        self.flags |= bits;
        if self.last_seen_ns < now_ns {
            self.last_seen_ns = now_ns;
        }
        if self.timeout_s == 0 || self.timeout_s > TCP_CLOSING_TIMEOUT_S {
            self.timeout_s = TCP_CLOSING_TIMEOUT_S;
        }
    }

    /// Whether this entry's TCP connection is over — reset, or FIN seen in both directions — and only lingers for
    /// its last segments. The data plane then moves both entries to `TRANSIENT_V4` (the flow sync does the same
    /// with a peer's closes); the GC no longer counts the connection as active.
    #[inline(always)]
    pub fn connection_closed(&self, partner: Option<&Flow<A>>) -> bool {
        let flags = self.flags | partner.map_or(0, |p| p.flags);
        flags & FLOW_F_RST != 0
            || (self.flags & FLOW_F_FIN != 0 && partner.is_some_and(|p| p.flags & FLOW_F_FIN != 0))
    }

    /// The key of the partner entry (the other direction of the same connection).
    #[inline(always)]
    pub fn partner_key(&self, proto: u8) -> FlowKey<A> {
        FlowKey {
            src: self.new_dst,
            dst: self.new_src,
            sport: self.new_dport,
            dport: self.new_sport,
            proto,
            _pad: [0; 3],
        }
    }
}

/// murmur3's 32-bit finaliser: cheap and well mixed (the flow hash, the SNAT port search, the flow filter).
#[inline(always)]
pub const fn fmix(mut h: u32) -> u32 {
    h ^= h >> 16;
    h = h.wrapping_mul(0x85eb_ca6b);
    h ^= h >> 13;
    h = h.wrapping_mul(0xc2b2_ae35);
    h ^= h >> 16;
    h
}

/// `FLOW_FILTER`: which keys of TCP entries `FLOWS_V4` may hold — and which forward keys of closed connections
/// `TRANSIENT_V4` may hold — as a bitmap indexed by a hash of the key. A clear bit means "certainly not there". So a
/// new connection's SYN looks its own key up (in both tables) only when the bit is set, and the SNAT port search
/// takes a port whose reverse key's bit is set as taken without looking it up: the lookups in the large tables
/// that would only miss were most of what a new flow cost. A set bit may belong to another key with the same bit,
/// or to a connection gone since: one more lookup, or one more port tried.
///
/// Bits are never cleared one by one (a connection can leave `FLOWS_V4` in many ways, LRU eviction among them,
/// without anyone seeing it); instead there are two generations, and the agent's GC rebuilds the inactive one
/// from a walk of both tables and then makes it the active one. Marks are set in both generations right after the
/// entry is written — by the data plane when a handshake completes (its reverse key is still held in
/// `TRANSIENT_V4` until then, so no SYN can take the port in between), by the agent when flow sync writes a peer's
/// connection. A closed connection's forward key moves from `FLOWS_V4` to `TRANSIENT_V4` marked, and the walk of
/// `TRANSIENT_V4` follows the walk of `FLOWS_V4`, so a move during the walks is seen by one of them. A mark that the
/// rebuild's clearing erased belongs to an entry written before the walk started, which the walk then marks. UDP
/// entries are not marked: only TCP's new-connection path consults the filter, and keys carry the protocol.
pub mod flow_filter {
    use super::{key_hash, FlowAddr, FlowKey};

    /// Bits per generation: 2^25 (4 MiB), about 11 % of bits set with 4M keys marked.
    pub const BITS_LOG2: u32 = 25;
    /// `u64` words per generation.
    pub const WORDS: u32 = 1 << (BITS_LOG2 - 6);
    /// Index of the element that holds the active generation (0 or 1), after both generations' words.
    pub const GENERATION_INDEX: u32 = 2 * WORDS;
    /// Elements of the map.
    pub const ENTRIES: u32 = 2 * WORDS + 1;

    /// The word (within a generation) and bit of `key`.
    #[inline(always)]
    pub fn slot<A: FlowAddr>(key: &FlowKey<A>) -> (u32, u64) {
        let h = key_hash(0x6a09_e667, key);
        ((h >> 6) & (WORDS - 1), 1 << (h & 63))
    }
}

/// A hash of a whole flow key, seeded so that the tables indexed by it (the flow filter, the handshake index) do
/// not collide for the same keys.
#[inline(always)]
pub fn key_hash<A: FlowAddr>(seed: u32, key: &FlowKey<A>) -> u32 {
    let mut h = key.src.mix(seed);
    h = key.dst.mix(h);
    h = fmix(h ^ (((key.sport as u32) << 16) | key.dport as u32));
    fmix(h ^ key.proto as u32)
}

/// PROXY protocol v2 on the packet path (HAProxy's spec, "2.2. Binary header format"). A connection of a service
/// with [`SVC_F_PROXY_V2`] carries the header as the first bytes of the client's stream: the data plane puts it in
/// front of the payload of the client's segment at the stream's first sequence number (the handshake's ACK, and any
/// later segment there until the backend acknowledges the header), and from then on the two sides count the
/// client's bytes `len` apart — the client's sequence numbers go `len` up towards the backend, the backend's
/// acknowledgements (and SACK blocks) `len` down towards the client. The header's bytes are the same at each
/// insertion, so a second copy at the same place is a duplicate TCP drops, never a second header in the stream.
pub mod proxy {
    /// The v2 signature, the header's first 12 bytes.
    pub const SIGNATURE: [u8; 12] = [
        0x0d, 0x0a, 0x0d, 0x0a, 0x00, 0x0d, 0x0a, 0x51, 0x55, 0x49, 0x54, 0x0a,
    ];
    /// Version 2, command PROXY.
    pub const VER_CMD: u8 = 0x21;
    /// AF_INET, STREAM.
    pub const FAM_TCP4: u8 = 0x11;
    /// AF_INET6, STREAM.
    pub const FAM_TCP6: u8 = 0x21;
    /// The header for IPv4: 16 bytes, then addresses (2 × 4) and ports (2 × 2).
    pub const HEADER_LEN_V4: u16 = 28;
    /// The header for IPv6: 16 bytes, then addresses (2 × 16) and ports (2 × 2).
    pub const HEADER_LEN_V6: u16 = 52;

    /// Whether a client's segment (not a SYN, not a RST) with sequence number `seq` gets the header in front of
    /// its payload: it starts where the stream starts (`proxy_seq`, host order) and the backend has not
    /// acknowledged the header yet.
    #[inline(always)]
    pub fn header_due(seq: u32, proxy_seq: u32, acked: bool) -> bool {
        !acked && seq == proxy_seq
    }

    /// The sequence number towards the backend of a client's segment (host order): unchanged where the header
    /// goes in front of it (or, for a RST, where the backend may not hold the header yet), `len` up after it.
    #[inline(always)]
    pub fn to_backend_seq(seq: u32, proxy_seq: u32, len: u16, acked: bool) -> u32 {
        if header_due(seq, proxy_seq, acked) {
            seq
        } else {
            seq.wrapping_add(len as u32)
        }
    }

    /// The acknowledgement (or SACK edge) towards the client of the backend's number `ack` (host order), and
    /// whether it covers the header: `len` down past the header; inside the header, the stream's start (the
    /// client has sent nothing the backend acknowledged).
    #[inline(always)]
    pub fn to_client_ack(ack: u32, proxy_seq: u32, len: u16) -> (u32, bool) {
        let d = ack.wrapping_sub(proxy_seq) as i32;
        if d >= len as i32 {
            (ack.wrapping_sub(len as u32), true)
        } else if d >= 0 {
            (proxy_seq, false)
        } else {
            (ack, false)
        }
    }
}

/// `HANDSHAKES`: where a client's handshake is. A handshake has one entry in `TRANSIENT_V4`, under its reverse key
/// (backend → SNAT port), which the backend's SYN-ACK looks up; it holds the forward entry too (see
/// [`TransientV4::fwd`]). The client's segments find that key here, in the slot of a hash of their own key: one
/// array element written per SYN (and again per SYN-ACK) instead of a second entry in the LRU table, which with its
/// lookup cost up to a third of a new flow. The slot is only a pointer: the entry it names counts only when its
/// forward entry is the client's (a slot overwritten by another client's SYN of the same hash makes that handshake
/// unreachable from the client's side until the backend's next SYN-ACK — one in 2^20 per handshake in flight).
pub mod handshakes {
    use super::{key_hash, FlowAddr, FlowKey};

    /// Slots of `HANDSHAKES`: 2^20 (16 MiB of 16-byte keys).
    pub const SLOTS_LOG2: u32 = 20;
    /// Elements of `HANDSHAKES`.
    pub const ENTRIES: u32 = 1 << SLOTS_LOG2;
    /// Elements of `HANDSHAKES_V6`: 2^18 (10 MiB of 40-byte keys; IPv6 clients are fewer today).
    pub const ENTRIES_V6: u32 = 1 << 18;

    /// Elements of the index of family `A`.
    #[inline(always)]
    pub fn entries<A: FlowAddr>() -> u32 {
        if A::FAMILY == super::FAMILY_V6 {
            ENTRIES_V6
        } else {
            ENTRIES
        }
    }

    /// The slot of a client's key (client → VIP).
    #[inline(always)]
    pub fn slot<A: FlowAddr>(key: &FlowKey<A>) -> u32 {
        key_hash(0xbb67_ae85, key) & (entries::<A>() - 1)
    }
}

/// Value of `TRANSIENT_V4`: a TCP flow that is not established. From the client's SYN until the client acknowledges
/// the backend's SYN-ACK (a handshake), and after it closed (FIN both ways, or RST), a connection lives in this small
/// LRU table of its own instead of `FLOWS_V4`. So a flood of SYNs from spoofed sources, and the churn of short
/// connections, recycle this table and never evict an established connection: only a completed handshake — an ACK
/// that acknowledges the SYN-ACK the backend sent, which a spoofing sender never sees — enters `FLOWS_V4`.
///
/// A handshake is one entry, under its reverse key, holding both directions (`flow` and `fwd`); the client's side
/// finds it through [`handshakes`]. A closed connection is two entries, one per key, as they were in `FLOWS_V4`
/// (`fwd` zero).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Transient<A> {
    /// The entry as it will be in `FLOWS_V4` (handshake: its reverse entry, `timeout_s` the service's idle timeout)
    /// or as it was there (closed: `timeout_s` is the closing timeout).
    pub flow: Flow<A>,
    /// A handshake with [`FLOW_F_SYN_ACK`]: the SYN-ACK's sequence number + 1, network order.
    pub ack_be: u32,
    /// Reserved, zero.
    pub _pad: u32,
    /// A handshake: its forward entry as it will be in `FLOWS_V4`. Zero in a closed connection's entries.
    pub fwd: Flow<A>,
}

/// Value of `TRANSIENT_V4` (the same rules hold for IPv6's `TRANSIENT_V6`, `FLOWS_V6` and `HANDSHAKES_V6`).
pub type TransientV4 = Transient<u32>;
/// Value of `TRANSIENT_V6`.
pub type TransientV6 = Transient<In6>;

impl<A: FlowAddr> Transient<A> {
    /// A handshake's entry (as opposed to one of a closed connection's two).
    #[inline(always)]
    pub fn handshake(&self) -> bool {
        self.fwd.flags & FLOW_F_FORWARD != 0
    }

    /// Whether this handshake is the one of the client's key `key` (client → VIP): its forward entry is what that
    /// key's packets become. (An index slot can name another client's handshake.)
    #[inline(always)]
    pub fn handshake_of(&self, key: &FlowKey<A>) -> bool {
        self.handshake() && self.flow.partner_key(key.proto) == *key
    }

    /// A closed flow (FIN or RST seen), as opposed to a handshake.
    #[inline(always)]
    pub fn closed(&self) -> bool {
        self.flow.flags & (FLOW_F_FIN | FLOW_F_RST) != 0
    }

    /// Past its lifetime at `now`: a handshake after [`TCP_HANDSHAKE_TIMEOUT_S`], a closed flow after its
    /// (closing) timeout.
    #[inline(always)]
    pub fn stale(&self, now_ns: u64) -> bool {
        if self.closed() {
            self.flow.idle(now_ns)
        } else {
            now_ns.saturating_sub(self.flow.last_seen_ns)
                > TCP_HANDSHAKE_TIMEOUT_S as u64 * 1_000_000_000
        }
    }
}

/// [`FlowEvent::kind`]: a flow was created (`key` is the forward entry, `rev` the reverse one).
pub const FLOW_EV_NEW: u8 = 1;
/// [`FlowEvent::kind`]: an entry saw its first FIN or RST (`key`/`fwd` are that entry, `rev` is zero).
pub const FLOW_EV_CLOSE: u8 = 2;
/// [`FlowEvent::kind`]: (user space only) the flow at `key` was used recently; only the age matters.
pub const FLOW_EV_REFRESH: u8 = 3;

/// A change of the connection-tracking table, published by the data plane on the `FLOW_EVENTS` ring buffer
/// (when [`CFG_F_SYNC_EVENTS`] is set) and replicated by the agents to their peers.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FlowEvent<A> {
    /// `FLOW_EV_*`.
    pub kind: u8,
    /// Reserved, zero.
    pub _pad: [u8; 7],
    /// The entry's key.
    pub key: FlowKey<A>,
    /// The entry's value.
    pub fwd: Flow<A>,
    /// [`FLOW_EV_NEW`]: the reverse entry, keyed by `fwd.partner_key(key.proto)`.
    pub rev: Flow<A>,
}

/// A record of `FLOW_EVENTS` (120 bytes).
pub type FlowEventV4 = FlowEvent<u32>;
/// A record of `FLOW_EVENTS_V6` (192 bytes).
pub type FlowEventV6 = FlowEvent<In6>;

/// A rare data-plane event with its details, for the agent's log (`KLOG_EVENTS` ring buffer; see
/// `lb-ebpf/src/klog.rs`). At most one per kind per CPU per second.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KernelEvent {
    /// `klog::KIND_*`.
    pub kind: u8,
    /// [`klog::KIND_MALFORMED`]: `klog::MALFORMED_*`, why the parser refused the frame.
    pub why: u8,
    /// A port, network order (the backend's node port for [`klog::KIND_SNAT_EXHAUSTED`]).
    pub port_be: u16,
    /// The service's id, where the event has one.
    pub svc_id: u32,
    /// The Maglev slot for [`klog::KIND_BAD_BACKEND`], or the frame's length for [`klog::KIND_MALFORMED`].
    pub value: u32,
    /// `FAMILY_V4` or `FAMILY_V6` when [`KernelEvent::addr`] holds an address, else 0.
    pub family: u8,
    /// Reserved, zero.
    pub _pad: [u8; 3],
    /// An address: the backend for SNAT exhaustion, the source for the SYN guard.
    pub addr: Addr,
}

/// [`KernelEvent`] kinds and reasons; each kind is named after the counter that counts it.
pub mod klog {
    /// No free SNAT port towards a backend (`drop_snat_exhausted`).
    pub const KIND_SNAT_EXHAUSTED: u8 = 0;
    /// A new flow's entries refused by the connection table (`drop_flow_insert`).
    pub const KIND_FLOW_INSERT: u8 = 1;
    /// A Maglev slot naming no IPv4 backend (`drop_bad_backend`).
    pub const KIND_BAD_BACKEND: u8 = 2;
    /// The SYN guard dropping SYNs of untrusted sources (`drop_syn_rate`).
    pub const KIND_SYN_GUARD: u8 = 3;
    /// A frame dropped as malformed (`drop_malformed`).
    pub const KIND_MALFORMED: u8 = 4;
    /// Number of kinds.
    pub const KINDS: u32 = 5;

    /// Shorter than an Ethernet header.
    pub const MALFORMED_ETHERNET: u8 = 0;
    /// The IPv4 header is cut short.
    pub const MALFORMED_IPV4_HEADER: u8 = 1;
    /// Version not 4, or IHL < 5.
    pub const MALFORMED_IPV4_VERSION: u8 = 2;
    /// Total length below the header length or beyond the frame.
    pub const MALFORMED_IPV4_LENGTH: u8 = 3;
    /// The TCP header is cut short, or its data offset is out of bounds.
    pub const MALFORMED_TCP: u8 = 4;
    /// The UDP header is cut short or beyond the IPv4 total length.
    pub const MALFORMED_UDP: u8 = 5;
    /// The ICMP header is cut short.
    pub const MALFORMED_ICMP: u8 = 6;
    /// The IPv6 header is cut short, or its version is not 6.
    pub const MALFORMED_IPV6_HEADER: u8 = 7;
    /// The IPv6 payload length reaches beyond the frame.
    pub const MALFORMED_IPV6_LENGTH: u8 = 8;
    /// An IPv6 extension header is cut short.
    pub const MALFORMED_IPV6_EXT: u8 = 9;
    /// The ICMPv6 header is cut short.
    pub const MALFORMED_ICMPV6: u8 = 10;
}

/// Bytes of a traced packet's headers kept before and after the program (Ethernet + IPv4 + TCP with room for
/// options, or an ICMP error with the quoted IPv4 header and ports).
pub const TRACE_HDR: usize = 96;

/// `lbctl trace`'s selection (`TRACE_FILTER`, one element), written by `lbctl` into the traced program's own map;
/// 0 matches anything.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TraceFilter {
    /// An address the packet comes from or goes to: a client, a node (family `addr_family`).
    pub addr: Addr,
    /// Destination address: a VIP (family `dst_family`).
    pub dst: Addr,
    /// Destination port, network order (IPv6: of a packet without extension headers).
    pub dport_be: u16,
    /// `FAMILY_V4`, `FAMILY_V6`, or 0: any address.
    pub addr_family: u8,
    /// The same for `dst`.
    pub dst_family: u8,
}

/// One packet seen by the traced program (`TRACE_EVENTS` ring buffer): its headers before and after, the
/// verdict and every counter it moved — the decision, in the data plane's own words.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TraceEvent {
    /// `bpf_ktime_get_ns` when it arrived.
    pub ts_ns: u64,
    /// Bit `i` set: global counter `stat::i` moved (the reason of a pass or drop, a new flow or handshake, …).
    pub reasons: u32,
    /// Frame length.
    pub len: u16,
    /// 1 pass, 2 drop, 3 sent back out (rewritten), 4 sent out of another interface (rewritten).
    pub verdict: u8,
    /// Bytes of the headers kept in `before` and `after` (at most [`TRACE_HDR`]).
    pub hdr_len: u8,
    pub before: [u8; TRACE_HDR],
    pub after: [u8; TRACE_HDR],
}

/// Per-CPU, per-service counters (`SERVICE_STATS`, index = service id). User space sums the CPUs.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ServiceStats {
    /// Packets client → backend.
    pub rx_packets: u64,
    /// IP bytes client → backend.
    pub rx_bytes: u64,
    /// Packets backend → client.
    pub tx_packets: u64,
    /// IP bytes backend → client.
    pub tx_bytes: u64,
    /// Flows established: TCP handshakes completed, UDP flows created.
    pub new_flows: u64,
    /// TCP flows that saw FIN or RST (first time per direction entry).
    pub closed_flows: u64,
    /// New flows dropped because the client is outside the source ranges.
    pub drop_source_range: u64,
    /// New flows dropped because no backend is healthy.
    pub drop_no_backend: u64,
    /// New flows dropped because no SNAT port was free after the bounded search.
    pub drop_snat_exhausted: u64,
    /// TCP packets without a flow that were not a SYN (dropped).
    pub drop_no_flow: u64,
    /// Forwarded packets passed to the kernel because the backend's next hop is unknown.
    pub pass_no_nexthop: u64,
    /// ICMP errors translated for this service's flows.
    pub icmp_translated: u64,
    /// TCP handshakes started (a SYN that opened a flow in `TRANSIENT_V4`).
    pub handshakes: u64,
    /// Client segments dropped because they did not complete the handshake: an ACK that does not acknowledge
    /// the backend's SYN-ACK (blind or spoofed), or a segment without ACK.
    pub drop_handshake: u64,
    /// SYNs dropped by the new-handshake rate guard (over [`Config::syn_interval_ns`]'s rate, from a source that
    /// never completed a handshake here).
    pub drop_syn_rate: u64,
    /// Clients reset because their connection's backend failed or left (see [`FLOW_F_END`]).
    pub reset_backend_gone: u64,
}

/// Indices of the global per-CPU `STATS` array (`u64` each). Forwarded packets and bytes are counted per
/// service only ([`ServiceStats`]): one counter update per packet on the fast path, not two.
pub mod stat {
    /// Passed: neither IPv4 nor IPv6 (ARP, LLDP, …).
    pub const PASS_NOT_IP: u32 = 0;
    /// Passed: IPv4 but not for a flow or service (including VRRP, ICMP echo, SSH to the VM).
    pub const PASS_NOT_SERVICE: u32 = 1;
    /// Dropped: malformed (truncated Ethernet/IP/L4 header, IHL < 5, total length out of bounds).
    pub const DROP_MALFORMED: u32 = 2;
    /// IPv4 packets that carried options (forwarded normally when they belong to a service).
    pub const IP_OPTIONS: u32 = 3;
    /// Dropped: a fragment addressed to a VIP (fragments are not load-balanced).
    pub const DROP_FRAGMENT: u32 = 4;
    /// Passed: a fragment for another address.
    pub const PASS_FRAGMENT: u32 = 5;
    /// Passed: next hop of the backend unknown (the kernel resolves it; the agent refreshes the table).
    pub const PASS_NO_NEXTHOP: u32 = 6;
    /// Dropped: TCP non-SYN packet for a service without a flow.
    pub const DROP_NO_FLOW: u32 = 7;
    /// ICMP errors translated (both directions).
    pub const ICMP_TRANSLATED: u32 = 8;
    /// Dropped: source range.
    pub const DROP_SOURCE_RANGE: u32 = 9;
    /// Dropped: no healthy backend.
    pub const DROP_NO_BACKEND: u32 = 10;
    /// Dropped: no SNAT port free.
    pub const DROP_SNAT_EXHAUSTED: u32 = 11;
    /// Dropped: the flow could not be stored (map error).
    pub const DROP_FLOW_INSERT: u32 = 12;
    /// Flows created.
    pub const NEW_FLOWS: u32 = 13;
    /// Dropped: Maglev slot or backend slot empty (table being rebuilt or inconsistent).
    pub const DROP_BAD_BACKEND: u32 = 14;
    /// Passed: ICMP error whose inner packet is not one of our flows.
    pub const PASS_ICMP_UNKNOWN: u32 = 15;
    /// Passed: addressed to another host's MAC (flooded on a shared segment; `CFG_F_CHECK_DST_MAC`).
    pub const PASS_OTHER_HOST: u32 = 16;
    /// Flow events not published because the ring buffer was full (the periodic refresh repairs them).
    pub const SYNC_EVENTS_LOST: u32 = 17;
    /// TCP handshakes started (SYNs that opened a flow in `TRANSIENT_V4`).
    pub const NEW_HANDSHAKES: u32 = 18;
    /// Dropped: a client segment that did not complete the handshake (see `ServiceStats::drop_handshake`).
    pub const DROP_HANDSHAKE: u32 = 19;
    /// Dropped: a SYN over the new-handshake rate from a source not in `TRUSTED_SOURCES` (see
    /// [`super::Config::syn_interval_ns`]).
    pub const DROP_SYN_RATE: u32 = 20;
    /// SYNs over the new-handshake rate let through because their source completed a handshake before.
    pub const SYN_TRUSTED: u32 = 21;
    /// Dropped: a UDP datagram over IPv6 to a service or flow with a zero checksum (forbidden by RFC 8200).
    pub const DROP_UDP6_NO_CHECKSUM: u32 = 22;
    /// IPv6 packets whose extension headers (hop-by-hop, routing, destination options) were walked; forwarded
    /// normally when they belong to a service, the headers untouched.
    pub const IPV6_EXT_HEADERS: u32 = 23;
    /// Passed: an IPv6 extension-header chain the program does not walk (longer than it looks, or a header it
    /// does not know); the kernel decides.
    pub const PASS_IPV6_EXT: u32 = 24;
    /// Passed: an IPv6 frame when the IPv6 program could not be reached (its tail call failed).
    pub const PASS_NO_IPV6_PROGRAM: u32 = 25;
    /// RSTs sent to clients whose connection's backend failed or left (see [`super::FLOW_F_END`]).
    pub const RESET_BACKEND_GONE: u32 = 26;
    /// PROXY v2 headers put in front of a client's segment (the first one of each connection, and again for a
    /// segment at the header's place before the backend acknowledged it).
    pub const PROXY_HEADERS: u32 = 27;
    /// Dropped: a client's segment of a PROXY v2 connection that could not take the header (the TC hook, which
    /// does not insert, or headers too long to move); the client retransmits.
    pub const DROP_PROXY: u32 = 28;
    /// Number of counters.
    pub const COUNT: u32 = 29;

    /// Names for metrics and logs, by index.
    pub const NAMES: [&str; COUNT as usize] = [
        "pass_not_ip",
        "pass_not_service",
        "drop_malformed",
        "ip_options",
        "drop_fragment",
        "pass_fragment",
        "pass_no_nexthop",
        "drop_no_flow",
        "icmp_translated",
        "drop_source_range",
        "drop_no_backend",
        "drop_snat_exhausted",
        "drop_flow_insert",
        "new_flows",
        "drop_bad_backend",
        "pass_icmp_unknown",
        "pass_other_host",
        "sync_events_lost",
        "new_handshakes",
        "drop_handshake",
        "drop_syn_rate",
        "syn_trusted",
        "drop_udp6_no_checksum",
        "ipv6_ext_headers",
        "pass_ipv6_ext",
        "pass_no_ipv6_program",
        "reset_backend_gone",
        "proxy_headers",
        "drop_proxy",
    ];
}

/// Index of the data plane's settings in the one-element `CONFIG` array.
pub const CONFIG_INDEX: u32 = 0;

/// Global data-plane settings (`CONFIG` array, one element).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Config {
    /// Lowest SNAT source port (host order).
    pub snat_port_min: u16,
    /// Highest SNAT source port (host order).
    pub snat_port_max: u16,
    /// Seed mixed into the flow hash; equal on every replica so they pick the same backends.
    pub hash_seed: u32,
    /// `CFG_F_*` bits.
    pub flags: u32,
    /// The attached interface's MAC, checked against frames' destination when [`CFG_F_CHECK_DST_MAC`] is set.
    pub local_mac: [u8; 6],
    /// Reserved, zero.
    pub _pad: [u8; 2],
    /// New-handshake rate guard, per CPU: one SYN may open a handshake every `syn_interval_ns` on average
    /// (0 = no guard). Over that rate only sources in `TRUSTED_SOURCES` (they completed a handshake before)
    /// open one; other SYNs are dropped before they cost a table insert and a backend's SYN-ACK.
    pub syn_interval_ns: u32,
    /// How far ahead of the average rate a CPU may run (burst tolerance of the guard), ns.
    pub syn_burst_ns: u32,
}

impl Config {
    /// Guard settings for `rate` new handshakes per second per CPU with a burst of `burst` SYNs (0 = off).
    pub fn with_syn_rate(mut self, rate: u32, burst: u32) -> Self {
        if rate == 0 {
            self.syn_interval_ns = 0;
            self.syn_burst_ns = 0;
        } else {
            let interval = (1_000_000_000 / rate as u64).max(1);
            self.syn_interval_ns = interval as u32;
            self.syn_burst_ns = (interval * burst as u64).min(u32::MAX as u64) as u32;
        }
        self
    }
}

/// Publish new and closing flows on the `FLOW_EVENTS` ring buffer (connection-state sync between replicas).
pub const CFG_F_SYNC_EVENTS: u32 = 1 << 0;
/// Only frames addressed to [`Config::local_mac`] are load-balanced; others (flooded unicast on a shared L2
/// segment, meant for the replica that holds the VIP) go to the kernel, which drops them as not ours.
pub const CFG_F_CHECK_DST_MAC: u32 = 1 << 1;

impl Default for Config {
    fn default() -> Self {
        Config {
            snat_port_min: 1024,
            snat_port_max: 65535,
            hash_seed: 0x5eed_1b01,
            flags: 0,
            local_mac: [0; 6],
            _pad: [0; 2],
            syn_interval_ns: 0,
            syn_burst_ns: 0,
        }
    }
}

/// How many ports the SNAT allocator tries for one new flow before giving up (bounded for the verifier).
pub const SNAT_PORT_TRIES: u32 = 32;

/// Names of the maps as declared in the eBPF object (and pinned under the agent's bpffs directory).
pub mod map_names {
    /// `HashMap<ServiceKey, Service>`.
    pub const SERVICES: &str = "SERVICES";
    /// `Array<Backend>`.
    pub const BACKENDS: &str = "BACKENDS";
    /// `Array<u32>`: Maglev tables of all services, each a slice `[table_offset, +table_size)`.
    pub const MAGLEV: &str = "MAGLEV";
    /// `HashMap<Addr, NextHop>`.
    pub const NEXTHOPS: &str = "NEXTHOPS";
    /// `Array<Egress>`, [`super::MAX_INTERFACES`] slots.
    pub const EGRESS: &str = "EGRESS";
    /// `DevMap`, the `EGRESS` slots' interfaces (XDP redirects).
    pub const EGRESS_DEVMAP: &str = "EGRESS_DEVMAP";
    /// `HashMap<u32, u32>`: interface index → its `EGRESS` slot (where a new flow's replies leave).
    pub const INTERFACES: &str = "INTERFACES";
    /// `LpmTrie<SourceRangeKey, u8>`.
    pub const SOURCE_RANGES: &str = "SOURCE_RANGES";
    /// `HashMap<Addr, u32>`: every address that carries at least one service (fragment policy).
    pub const VIPS: &str = "VIPS";
    /// `LruHashMap<FlowKeyV4, FlowV4>`: established connections and UDP flows.
    pub const FLOWS_V4: &str = "FLOWS_V4";
    /// `LruHashMap<FlowKeyV4, TransientV4>`: TCP handshakes and closed connections.
    pub const TRANSIENT_V4: &str = "TRANSIENT_V4";
    /// `LruHashMap<FlowKeyV6, FlowV6>`: IPv6's `FLOWS_V4`.
    pub const FLOWS_V6: &str = "FLOWS_V6";
    /// `LruHashMap<FlowKeyV6, TransientV6>`: IPv6's `TRANSIENT_V4`.
    pub const TRANSIENT_V6: &str = "TRANSIENT_V6";
    /// `Array<FlowKeyV6>` of [`super::handshakes::ENTRIES_V6`]: IPv6's `HANDSHAKES`.
    pub const HANDSHAKES_V6: &str = "HANDSHAKES_V6";
    /// `RingBuf` of [`super::FlowEventV6`]s: IPv6's `FLOW_EVENTS`.
    pub const FLOW_EVENTS_V6: &str = "FLOW_EVENTS_V6";
    /// `ProgramArray` of the IPv6 XDP programs (index [`super::V6_PROG_FAST`], [`super::V6_PROG_TRACED`]), which
    /// the XDP entry points tail-call for IPv6 frames.
    pub const V6_PROGS_XDP: &str = "V6_PROGS_XDP";
    /// `ProgramArray` of the IPv6 TC programs, as [`V6_PROGS_XDP`] for the TC entry points.
    pub const V6_PROGS_TC: &str = "V6_PROGS_TC";
    /// `LruHashMap<Addr, u8>`: sources that completed a TCP handshake (the rate guard lets them through).
    pub const TRUSTED_SOURCES: &str = "TRUSTED_SOURCES";
    /// `Array<u64>` (memory-mappable) of [`super::flow_filter::ENTRIES`]: which TCP keys `FLOWS_V4` may hold.
    pub const FLOW_FILTER: &str = "FLOW_FILTER";
    /// `Array<FlowKeyV4>` of [`super::handshakes::ENTRIES`]: the reverse key of a client's handshake, by a hash of
    /// the client's key.
    pub const HANDSHAKES: &str = "HANDSHAKES";
    /// `PerCpuArray<u64>`, one element: the SYN rate guard's state per CPU (theoretical arrival time, ns).
    pub const SYN_GUARD: &str = "SYN_GUARD";
    /// `PerCpuArray<ServiceStats>`.
    pub const SERVICE_STATS: &str = "SERVICE_STATS";
    /// `PerCpuArray<u64>`, indices in [`super::stat`].
    pub const STATS: &str = "STATS";
    /// `Array<Config>`, one element.
    pub const CONFIG: &str = "CONFIG";
    /// `RingBuf` of [`super::FlowEventV4`]s.
    pub const FLOW_EVENTS: &str = "FLOW_EVENTS";
    /// `Array<TraceFilter>`, one element: what the traced program reports (its own, never pinned).
    pub const TRACE_FILTER: &str = "TRACE_FILTER";
    /// `RingBuf` of [`super::TraceEvent`]s from the traced program (its own, never pinned).
    pub const TRACE_EVENTS: &str = "TRACE_EVENTS";
}

/// Index of the fast IPv6 program in `V6_PROGS_XDP` / `V6_PROGS_TC`.
pub const V6_PROG_FAST: u32 = 0;
/// Index of the traced IPv6 program (`lbctl trace`).
pub const V6_PROG_TRACED: u32 = 1;
/// Index of the IPv6 new-flow program, tail-called by the fast IPv6 program for a packet that opens a flow (its
/// own program: a fresh 512-byte stack for the new-flow path).
pub const V6_PROG_NEW_FLOW: u32 = 2;
/// Index of the traced new-flow program, tail-called by the traced IPv6 program.
pub const V6_PROG_NEW_FLOW_TRACED: u32 = 3;
/// Slots of `V6_PROGS_XDP` / `V6_PROGS_TC`.
pub const V6_PROGS: u32 = 4;

/// Default capacities, overridable by the agent at load time.
pub mod defaults {
    /// Services (VIP, port, protocol).
    pub const MAX_SERVICES: u32 = 4096;
    /// Backend slots.
    pub const MAX_BACKENDS: u32 = 65536;
    /// Maglev arena slots (u32 each): 4 MiB.
    pub const MAGLEV_SLOTS: u32 = 1 << 20;
    /// Connection-tracking entries (two per connection).
    pub const MAX_FLOWS: u32 = 1 << 20;
    /// IPv6 connection-tracking entries (72-byte values and 40-byte keys: about 40 MiB preallocated).
    pub const MAX_FLOWS_V6: u32 = 1 << 18;
    /// Entries for TCP handshakes (one each) and closed connections (two each). Each handshake holds a SNAT port:
    /// a table that holds more handshakes than a few backends have ports lets a SYN flood fill their port ranges
    /// (every SYN then tries 32 taken ports and is dropped) instead of recycling the oldest handshakes. 65 536 is
    /// as many handshakes as the table held before a handshake became one entry (131 072 entries, two each).
    pub const MAX_TRANSIENT: u32 = 1 << 16;
    /// IPv6's `TRANSIENT_V6` entries.
    pub const MAX_TRANSIENT_V6: u32 = 1 << 16;
    /// Sources remembered as having completed a TCP handshake (the SYN rate guard's allow list).
    pub const MAX_TRUSTED_SOURCES: u32 = 1 << 16;
    /// New TCP handshakes per second per CPU before the SYN rate guard drops untrusted sources' SYNs. Each one
    /// costs a few µs here and a SYN-ACK from a backend; at 40 000 a full-rate flood still broke held connections
    /// on the 2-core test rig, at 10 000 none (`cargo xtask bench synflood`).
    pub const SYN_RATE: u32 = 10_000;
    /// SYNs a CPU may take at once above that rate (100 ms worth).
    pub const SYN_BURST: u32 = 1_000;
    /// Next-hop entries.
    pub const MAX_NEXTHOPS: u32 = 4096;
    /// Source-range prefixes over all services.
    pub const MAX_SOURCE_RANGES: u32 = 16384;
}

#[cfg(feature = "user")]
mod pod {
    // SAFETY: every type is repr(C), Copy, made only of integers and arrays of them, with padding named.
    unsafe impl aya::Pod for super::Addr {}
    unsafe impl aya::Pod for super::ServiceKey {}
    unsafe impl aya::Pod for super::Service {}
    unsafe impl aya::Pod for super::Backend {}
    unsafe impl aya::Pod for super::NextHop {}
    unsafe impl aya::Pod for super::Egress {}
    unsafe impl aya::Pod for super::SourceRangeKey {}
    unsafe impl<A: super::FlowAddr> aya::Pod for super::FlowKey<A> {}
    unsafe impl<A: super::FlowAddr> aya::Pod for super::Flow<A> {}
    unsafe impl<A: super::FlowAddr> aya::Pod for super::Transient<A> {}
    unsafe impl aya::Pod for super::ServiceStats {}
    unsafe impl aya::Pod for super::KernelEvent {}
    unsafe impl aya::Pod for super::Config {}
    unsafe impl<A: super::FlowAddr> aya::Pod for super::FlowEvent<A> {}
    unsafe impl aya::Pod for super::TraceFilter {}
}

#[cfg(test)]
mod tests {
    use super::*;
    use core::mem::size_of;

    // Sizes are part of the pinned-map ABI: a change here needs a LAYOUT_VERSION bump.
    #[test]
    fn layout_sizes_are_stable() {
        assert_eq!(size_of::<Addr>(), 16);
        assert_eq!(size_of::<ServiceKey>(), 20);
        assert_eq!(size_of::<Service>(), 40);
        assert_eq!(size_of::<Backend>(), 20);
        assert_eq!(size_of::<NextHop>(), 12);
        assert_eq!(size_of::<SourceRangeKey>(), 20);
        assert_eq!(size_of::<FlowKeyV4>(), 16);
        assert_eq!(size_of::<FlowV4>(), 56);
        assert_eq!(size_of::<TransientV4>(), 120);
        assert_eq!(size_of::<FlowEventV4>(), 136);
        // IPv6: the same fields, every one at a natural alignment without implicit padding.
        assert_eq!(size_of::<FlowKeyV6>(), 40);
        assert_eq!(size_of::<FlowV6>(), 80);
        assert_eq!(size_of::<TransientV6>(), 168);
        assert_eq!(size_of::<FlowEventV6>(), 208);
        assert_eq!(size_of::<KernelEvent>(), 32);
        assert_eq!(size_of::<ServiceStats>(), 128);
        assert_eq!(size_of::<Config>(), 28);
        assert_eq!(stat::NAMES.len(), stat::COUNT as usize);
    }

    #[test]
    fn proxy_numbers_translate_around_the_header_also_across_the_wrap() {
        use proxy::{header_due, to_backend_seq, to_client_ack};
        for start in [1000u32, u32::MAX - 10] {
            let n = proxy::HEADER_LEN_V4;
            // The stream's start takes the header until the backend acknowledges it; then it is only shifted.
            assert!(header_due(start, start, false));
            assert!(!header_due(start, start, true));
            assert_eq!(to_backend_seq(start, start, n, false), start);
            assert_eq!(
                to_backend_seq(start, start, n, true),
                start.wrapping_add(28)
            );
            assert_eq!(
                to_backend_seq(start.wrapping_add(5), start, n, false),
                start.wrapping_add(33)
            );
            // Acknowledgements: before the header, inside it, past it.
            assert_eq!(to_client_ack(start, start, n), (start, false));
            assert_eq!(
                to_client_ack(start.wrapping_add(27), start, n),
                (start, false)
            );
            assert_eq!(
                to_client_ack(start.wrapping_add(28), start, n),
                (start, true)
            );
            assert_eq!(
                to_client_ack(start.wrapping_add(33), start, n),
                (start.wrapping_add(5), true)
            );
            assert_eq!(
                to_client_ack(start.wrapping_sub(1), start, n),
                (start.wrapping_sub(1), false)
            );
        }
    }

    #[test]
    fn the_flow_filter_spreads_keys_over_its_words_and_bits() {
        // The 2^16 reverse keys of one node:NodePort (every SNAT port) land in distinct slots but for the
        // few collisions the table's size predicts.
        let mut seen = [0u64; 1024];
        let mut collisions = 0;
        for port in 0..=u16::MAX {
            let k = FlowKeyV4 {
                src: 0x0a00_0001,
                dst: 0xcb00_7101,
                sport: 30080u16.to_be(),
                dport: port.to_be(),
                proto: PROTO_TCP,
                _pad: [0; 3],
            };
            let (w, bit) = flow_filter::slot(&k);
            assert!(w < flow_filter::WORDS && bit.count_ones() == 1);
            // A small projection of the 2^25 slots, enough to see clustering.
            let i = (w as usize * 64 + bit.trailing_zeros() as usize) % (1024 * 64);
            if seen[i / 64] & (1 << (i % 64)) != 0 {
                collisions += 1;
            }
            seen[i / 64] |= 1 << (i % 64);
        }
        // 65 536 keys into 65 536 projected slots: ~1/e of them collide if the hash is uniform.
        assert!((20_000..28_000).contains(&collisions), "{collisions}");
        assert_eq!(fmix(0), 0);
        assert_eq!(fmix(1), 0x514e_28b7);
    }

    #[test]
    fn v4_addresses_round_trip() {
        let raw = u32::from_ne_bytes([10, 0, 0, 1]);
        let a = Addr::from_v4_raw(raw);
        assert_eq!(&a.bytes[..4], &[10, 0, 0, 1]);
        assert_eq!(a.v4_raw(), raw);
    }

    #[test]
    fn v6_addresses_round_trip_in_wire_order() {
        let bytes = [
            0x20, 0x01, 0x0d, 0xb8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x12, 0x34,
        ];
        let raw: In6 = core::array::from_fn(|i| {
            u32::from_ne_bytes(bytes[i * 4..i * 4 + 4].try_into().unwrap())
        });
        let a = Addr::from_v6_raw(raw);
        assert_eq!(a.bytes, bytes);
        assert_eq!(a.v6_raw(), raw);
        assert_eq!(raw.to_addr(), a);
    }

    #[test]
    fn closing_shortens_the_timeout_and_keeps_the_newer_age() {
        let mut e = FlowV4 {
            timeout_s: 3600,
            last_seen_ns: 500,
            ..Default::default()
        };
        e.close(FLOW_F_FIN, 100);
        assert_eq!((e.timeout_s, e.last_seen_ns), (TCP_CLOSING_TIMEOUT_S, 500));
        assert_eq!(e.flags & FLOW_F_FIN, FLOW_F_FIN);
        let mut never = FlowV4::default();
        never.close(FLOW_F_RST, 700);
        assert_eq!(
            (never.timeout_s, never.last_seen_ns),
            (TCP_CLOSING_TIMEOUT_S, 700)
        );
        let mut short = FlowV4 {
            timeout_s: 5,
            ..Default::default()
        };
        short.close(FLOW_F_FIN, 1);
        assert_eq!(short.timeout_s, 5, "a shorter idle timeout stays");
    }

    #[test]
    fn a_connection_is_idle_when_both_entries_are_or_its_partner_is_gone() {
        let s = 1_000_000_000;
        let idle = FlowV4 {
            timeout_s: 1,
            last_seen_ns: 0,
            ..Default::default()
        };
        let busy = FlowV4 {
            last_seen_ns: 10 * s,
            ..idle
        };
        let now = 10 * s;
        assert!(idle.connection_idle(now, || Some(&idle)));
        assert!(idle.connection_idle(now, || None));
        assert!(
            !idle.connection_idle(now, || Some(&busy)),
            "a one-way stream"
        );
        assert!(!busy.connection_idle(now, || unreachable!("not looked up")));
    }

    #[test]
    fn partner_key_turns_the_rewrite_around() {
        let f = FlowV4 {
            new_src: 1,
            new_dst: 2,
            new_sport: 3,
            new_dport: 4,
            ..Default::default()
        };
        let k = f.partner_key(PROTO_TCP);
        assert_eq!(
            (k.src, k.dst, k.sport, k.dport, k.proto),
            (2, 1, 4, 3, PROTO_TCP)
        );
    }
}
