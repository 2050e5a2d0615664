//! Full NAT: VIP:port → node:NodePort with SNAT, connection tracking, source ranges, idle timeouts and ICMP
//! error translation. See README "Data plane" for the rules this implements.

use aya_ebpf::{bindings::BPF_NOEXIST, helpers::bpf_ktime_get_coarse_ns, maps::lpm_trie::Key};
use lb_common::{
    stat, Addr, Config, FlowEvent, FlowKeyV4, FlowV4, Service, ServiceKey, SourceRangeKey,
    CFG_F_CHECK_DST_MAC, CFG_F_SYNC_EVENTS, FAMILY_V4, FLOW_EV_CLOSE, FLOW_EV_NEW, FLOW_F_FIN,
    FLOW_F_FORWARD, FLOW_F_REVERSE, FLOW_F_RST, FLOW_F_SYNCED, PROTO_ICMP, PROTO_TCP, PROTO_UDP,
    SNAT_PORT_TRIES, SOURCE_RANGE_ID_BITS, SVC_F_SOURCE_RANGES, TCP_CLOSING_TIMEOUT_S,
};

use crate::{
    csum,
    ctx::{ptr_at, Ctx},
    hdr::*,
    maps::{
        count, with_service_stats, BACKENDS, CONFIG, FLOWS_V4, FLOW_EVENTS, MAGLEV, NEXTHOPS,
        SCRATCH, SERVICES, SOURCE_RANGES, TRANSIENT_V4, VIPS,
    },
    syn_guard, transient,
};

/// What to do with the packet; each hook maps it to its own return code.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Hand to the kernel unchanged.
    Pass,
    /// Drop.
    Drop,
    /// Send back out of the interface it came in on (rewritten).
    Tx,
}

const NS_PER_S: u64 = 1_000_000_000;

/// Processes one frame.
#[inline(always)]
pub fn process<C: Ctx>(c: &C) -> Verdict {
    let Some(eth) = ptr_at::<C, EthHdr>(c, 0) else {
        count(stat::DROP_MALFORMED);
        return Verdict::Drop;
    };
    // SAFETY (all header dereferences below): pointers come from `ptr_at`, which checked the bounds.
    if unsafe { (*eth).proto } != ETH_P_IP_BE {
        count(stat::PASS_NOT_IPV4);
        return Verdict::Pass;
    }
    let cfg = config();
    if cfg.flags & CFG_F_CHECK_DST_MAC != 0 && !same_mac(unsafe { &(*eth).dst }, &cfg.local_mac) {
        // Another replica's frame, flooded by the segment: forwarding it too would duplicate it.
        count(stat::PASS_OTHER_HOST);
        return Verdict::Pass;
    }
    let Some(ip) = ptr_at::<C, Ipv4Hdr>(c, ETH_LEN) else {
        count(stat::DROP_MALFORMED);
        return Verdict::Drop;
    };
    let vihl = unsafe { (*ip).vihl };
    let ihl = (vihl & 0x0f) as usize;
    if vihl >> 4 != 4 || ihl < 5 {
        count(stat::DROP_MALFORMED);
        return Verdict::Drop;
    }
    let hl = ihl * 4;
    let tot = u16::from_be(unsafe { (*ip).tot_len }) as usize;
    // Trailing bytes after `tot` are link padding and allowed; a length beyond the frame is not.
    if tot < hl || tot + ETH_LEN > c.packet_len() {
        count(stat::DROP_MALFORMED);
        return Verdict::Drop;
    }
    if ihl > 5 {
        // Options are left untouched; only addresses change, and the L4 offset follows IHL.
        count(stat::IP_OPTIONS);
    }
    let dst = unsafe { (*ip).dst };
    if u16::from_be(unsafe { (*ip).frag_off }) & IP_MF_OFFSET_MASK != 0 {
        // Non-first fragments carry no ports, so they cannot be matched to a flow: fragments for our
        // addresses are dropped (clients use PMTUD, which the ICMP translation below keeps working),
        // everything else is the kernel's business.
        return if VIPS.get_ptr(Addr::from_v4_raw(dst)).is_some() {
            count(stat::DROP_FRAGMENT);
            Verdict::Drop
        } else {
            count(stat::PASS_FRAGMENT);
            Verdict::Pass
        };
    }
    let l4_off = ETH_LEN + hl;
    match unsafe { (*ip).proto } {
        PROTO_TCP => {
            let Some(tcp) = ptr_at::<C, TcpHdr>(c, l4_off) else {
                count(stat::DROP_MALFORMED);
                return Verdict::Drop;
            };
            let doff = (unsafe { (*tcp).doff } >> 4) as usize * 4;
            if doff < TCP_LEN || hl + doff > tot {
                count(stat::DROP_MALFORMED);
                return Verdict::Drop;
            }
            let p = unsafe {
                L4Pkt {
                    eth,
                    ip,
                    ports: tcp as *mut Ports,
                    key: flow_key(ip, tcp as *mut Ports, PROTO_TCP),
                    tcp_flags: (*tcp).flags,
                    tcp,
                    tot: tot as u16,
                }
            };
            l4(c, &cfg, &p)
        }
        PROTO_UDP => {
            let Some(udp) = ptr_at::<C, UdpHdr>(c, l4_off) else {
                count(stat::DROP_MALFORMED);
                return Verdict::Drop;
            };
            if hl + UDP_LEN > tot {
                count(stat::DROP_MALFORMED);
                return Verdict::Drop;
            }
            let p = L4Pkt {
                eth,
                ip,
                ports: udp as *mut Ports,
                key: flow_key(ip, udp as *mut Ports, PROTO_UDP),
                tcp_flags: 0,
                tcp: core::ptr::null_mut(),
                tot: tot as u16,
            };
            l4(c, &cfg, &p)
        }
        PROTO_ICMP => icmp(c, eth, ip, l4_off, ETH_LEN + tot),
        _ => {
            count(stat::PASS_NOT_SERVICE);
            Verdict::Pass
        }
    }
}

/// A TCP or UDP packet, parsed once: the headers it is rewritten through and what the flow rules read. Kept
/// small: it lives on the BPF stack for the whole path (older kernels' verifiers refuse a program whose call
/// frames add up to more than 512 bytes; the build checks the main frame against 448).
pub struct L4Pkt {
    /// Start of the frame (Ethernet header).
    pub eth: *mut EthHdr,
    pub ip: *mut Ipv4Hdr,
    /// The L4 header's ports (TCP or UDP).
    pub ports: *mut Ports,
    /// The TCP header (null for UDP): sequence and acknowledgement numbers are read only where the handshake
    /// rules need them, off the established path.
    pub tcp: *mut TcpHdr,
    /// The 5-tuple as it arrived.
    pub key: FlowKeyV4,
    /// IP total length.
    pub tot: u16,
    /// TCP flags (0 for UDP).
    pub tcp_flags: u8,
}

impl L4Pkt {
    #[inline(always)]
    fn is_tcp(&self) -> bool {
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
    fn csum(&self) -> (*mut u16, usize) {
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
fn flow_key(ip: *mut Ipv4Hdr, ports: *mut Ports, proto: u8) -> FlowKeyV4 {
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

/// TCP or UDP: follow an established flow, a TCP handshake or a closed connection, or open a flow for a
/// service.
// New entries go into the map by reference to their scratch slot: a copy would land on the BPF stack.
#[allow(clippy::needless_borrows_for_generic_args)]
#[inline(always)]
fn l4<C: Ctx>(c: &C, cfg: &Config, p: &L4Pkt) -> Verdict {
    let key = p.key;
    let proto = key.proto;
    let syn = p.syn();
    let now = unsafe { bpf_ktime_get_coarse_ns() };
    // The flow this packet's client port had before, released when a new one is made on it.
    // (The entry itself, not its partner's key: 8 bytes of stack instead of 20.)
    let mut reopen: Option<*const FlowV4> = None;
    let skey = ServiceKey {
        addr: Addr::from_v4_raw(key.dst),
        port_be: key.dport,
        proto,
        family: FAMILY_V4,
    };
    // Over the new-handshake rate, a SYN for a service from an unknown source (a spoofed flood) is dropped
    // before it costs a lookup in the large tables.
    if syn && syn_guard::over_rate(cfg, now) {
        if let Some(svc) = SERVICES.get_ptr(skey) {
            if !syn_guard::trusted(key.src) {
                count(stat::DROP_SYN_RATE);
                with_service_stats(unsafe { (*svc).id }, |s| s.drop_syn_rate += 1);
                return Verdict::Drop;
            }
        }
    }

    if let Some(fp) = FLOWS_V4.get_ptr_mut(key) {
        let fl = unsafe { &mut *fp };
        let forward = fl.flags & FLOW_F_FORWARD != 0;
        // A SYN on a closing flow opens a new connection on a reused client port; an idle-expired forward
        // entry no longer counts. Reverse entries never decide: replies follow whatever state exists.
        let closing_syn = syn && fl.flags & (FLOW_F_FIN | FLOW_F_RST) != 0;
        if !forward || !(closing_syn || expired(fl, proto, now)) {
            return established(c, cfg, p, fl, now);
        }
        reopen = Some(fp);
    }
    let svc = SERVICES.get_ptr(skey);
    // Handshakes and closed connections: a client's segment to a service, or a backend's to a SNAT port. (Other
    // traffic — SSH to the VM, a low port on the VIP — skips the lookup.)
    let dport = u16::from_be(key.dport);
    if p.is_tcp() && (svc.is_some() || (cfg.snat_port_min..=cfg.snat_port_max).contains(&dport)) {
        if let Some(tp) = TRANSIENT_V4.get_ptr_mut(key) {
            if let Some(v) = transient::segment(c, cfg, p, unsafe { &mut *tp }, reopen, now) {
                return v;
            }
        }
    }
    // No usable flow: is it for a service?
    let Some(svc) = svc else {
        count(stat::PASS_NOT_SERVICE);
        return Verdict::Pass;
    };
    // A reference into the map: a copy would take 40 bytes of the BPF stack.
    let svc = unsafe { &*svc };
    if p.is_tcp() && !syn {
        // Only a SYN creates a TCP flow. A stray segment (state lost, port scan, ACK flood) is dropped:
        // the kernel would answer with a RST, which kills connections a peer replica may still carry.
        count(stat::DROP_NO_FLOW);
        with_service_stats(svc.id, |s| s.drop_no_flow += 1);
        return Verdict::Drop;
    }
    let t = match pick_backend(cfg, p, svc) {
        Ok(t) => t,
        Err(v) => return v,
    };
    if p.is_tcp() {
        if let Some(old) = reopen {
            // The previous connection on this client port is over: its entries go now, so that the new one's
            // segments cannot follow them.
            let _ = FLOWS_V4.remove(unsafe { &*old }.partner_key(proto));
            let _ = FLOWS_V4.remove(key);
        }
        // The handshake waits in TRANSIENT_V4; FLOWS_V4 gets the connection when the client completes it.
        return transient::open(c, cfg, p, svc, &t, now);
    }
    // Both entries are built in per-CPU scratch space: on the stack they would push the program past what older
    // kernels' verifiers accept (see `maps::SCRATCH`).
    let (Some(rs), Some(fs)) = (SCRATCH.get_ptr_mut(0), SCRATCH.get_ptr_mut(1)) else {
        count(stat::DROP_FLOW_INSERT);
        return Verdict::Drop;
    };
    // SAFETY (`rs`, `fs`): this CPU's scratch slots; nothing else runs on this CPU meanwhile.
    unsafe { (*rs).flow = t.reverse(p, svc, now) };
    let Some(snat_port) = alloc_snat_port(cfg, &t, p, |rkey, csum_port| {
        unsafe { (*rs).flow.csum_port = csum_port };
        FLOWS_V4
            .insert(rkey, unsafe { &(*rs).flow }, BPF_NOEXIST as u64)
            .is_ok()
    }) else {
        count(stat::DROP_SNAT_EXHAUSTED);
        with_service_stats(svc.id, |s| s.drop_snat_exhausted += 1);
        return Verdict::Drop;
    };
    unsafe { (*fs).flow = t.forward(p, svc, snat_port, now) };
    let (fwd, rev) = unsafe { (&(*fs).flow, &(*rs).flow) };
    let rkey = fwd.partner_key(proto);
    if let Some(old) = reopen {
        // The previous connection on this client port is over: release its reverse entry (and port).
        let _ = FLOWS_V4.remove(unsafe { &*old }.partner_key(proto));
    }
    if FLOWS_V4.insert(key, fwd, 0).is_err() {
        let _ = FLOWS_V4.remove(rkey);
        count(stat::DROP_FLOW_INSERT);
        return Verdict::Drop;
    }
    established_new(cfg, &key, fwd, rev);
    forward(c, p, fwd)
}

/// A packet of an established flow (or of a reply direction, which follows whatever state exists): counted,
/// tracked, rewritten. A connection that this packet closes (RST, or the second FIN) leaves `FLOWS_V4` for
/// `TRANSIENT_V4`, where its last segments still find it.
#[inline(always)]
fn established<C: Ctx>(c: &C, cfg: &Config, p: &L4Pkt, fl: &mut FlowV4, now: u64) -> Verdict {
    let closed = track(cfg, &p.key, fl, p.key.proto, p.tcp_flags, now);
    let v = forward(c, p, fl);
    if closed {
        transient::retire(&p.key, fl);
    }
    v
}

/// Counts a packet of a flow (established or transient) in its direction and rewrites it.
#[inline(always)]
pub fn forward<C: Ctx>(c: &C, p: &L4Pkt, fl: &FlowV4) -> Verdict {
    let fwd_dir = fl.flags & FLOW_F_FORWARD != 0;
    with_service_stats(fl.svc_id, |s| {
        if fwd_dir {
            s.rx_packets += 1;
            s.rx_bytes += p.tot as u64;
        } else {
            s.tx_packets += 1;
            s.tx_bytes += p.tot as u64;
        }
    });
    rewrite(c, p, fl)
}

/// Counts a flow that entered `FLOWS_V4` (a completed TCP handshake or a new UDP flow) and publishes it for the
/// peers' connection-state sync.
#[inline(always)]
pub fn established_new(cfg: &Config, key: &FlowKeyV4, fwd: &FlowV4, rev: &FlowV4) {
    count(stat::NEW_FLOWS);
    with_service_stats(fwd.svc_id, |s| s.new_flows += 1);
    if cfg.flags & CFG_F_SYNC_EVENTS != 0 {
        publish(FLOW_EV_NEW, key, fwd, Some(rev));
    }
}

/// The backend a new flow goes to, and how to reach it.
pub struct Target {
    pub backend_id: u32,
    pub node: u32,
    pub node_port: u16,
    pub mac: [u8; 6],
    pub snat: u32,
    /// The flow's hash (also seeds the SNAT port search).
    pub hash: u32,
}

impl Target {
    /// The reverse entry (backend → SNAT) of a new flow; its port fields are completed by the SNAT search.
    #[inline(always)]
    pub fn reverse(&self, p: &L4Pkt, svc: &Service, now: u64) -> FlowV4 {
        let key = &p.key;
        FlowV4 {
            new_src: key.dst,
            new_dst: key.src,
            new_sport: key.dport,
            new_dport: key.sport,
            mac: unsafe { (*p.eth).src },
            flags: FLOW_F_REVERSE,
            _pad: 0,
            svc_id: svc.id,
            backend_id: self.backend_id,
            timeout_s: svc.idle_timeout_s,
            csum_addr: csum::add(
                csum::diff32(self.node, key.dst),
                csum::diff32(self.snat, key.src),
            ),
            csum_port: 0,
            last_seen_ns: now,
        }
    }

    /// The forward entry (client → backend) of a new flow with SNAT port `snat_port`.
    #[inline(always)]
    pub fn forward(&self, p: &L4Pkt, svc: &Service, snat_port: u16, now: u64) -> FlowV4 {
        let key = &p.key;
        FlowV4 {
            new_src: self.snat,
            new_dst: self.node,
            new_sport: snat_port,
            new_dport: self.node_port,
            mac: self.mac,
            flags: FLOW_F_FORWARD,
            _pad: 0,
            svc_id: svc.id,
            backend_id: self.backend_id,
            timeout_s: svc.idle_timeout_s,
            csum_addr: csum::add(
                csum::diff32(key.src, self.snat),
                csum::diff32(key.dst, self.node),
            ),
            csum_port: csum::add(
                csum::diff16(key.sport, snat_port),
                csum::diff16(key.dport, self.node_port),
            ),
            last_seen_ns: now,
        }
    }
}

/// Source ranges, Maglev, backend and next hop for a new flow of `svc`; the verdict after counting why not.
#[inline(always)]
fn pick_backend(cfg: &Config, p: &L4Pkt, svc: &Service) -> Result<Target, Verdict> {
    let key = &p.key;
    if svc.flags & SVC_F_SOURCE_RANGES != 0 {
        let k = Key::new(
            SOURCE_RANGE_ID_BITS + 32,
            SourceRangeKey {
                svc_id_be: svc.id.to_be(),
                addr: Addr::from_v4_raw(key.src),
            },
        );
        if SOURCE_RANGES.get(&k).is_none() {
            count(stat::DROP_SOURCE_RANGE);
            with_service_stats(svc.id, |s| s.drop_source_range += 1);
            return Err(Verdict::Drop);
        }
    }
    if svc.table_size == 0 {
        count(stat::DROP_NO_BACKEND);
        with_service_stats(svc.id, |s| s.drop_no_backend += 1);
        return Err(Verdict::Drop);
    }
    let hash = flow_hash(key, cfg.hash_seed);
    let slot = svc.table_offset + rem(hash, svc.table_size);
    let Some(&backend_id) = MAGLEV.get(slot) else {
        count(stat::DROP_BAD_BACKEND);
        return Err(Verdict::Drop);
    };
    let Some(backend) = BACKENDS.get(backend_id) else {
        count(stat::DROP_BAD_BACKEND);
        return Err(Verdict::Drop);
    };
    if backend.family != FAMILY_V4 {
        count(stat::DROP_BAD_BACKEND);
        return Err(Verdict::Drop);
    }
    let Some(nh) = NEXTHOPS.get_ptr(backend.addr) else {
        // The kernel gets the packet unchanged and resolves the neighbour; the agent notices the counter
        // and refreshes the table. The client retransmits.
        count(stat::PASS_NO_NEXTHOP);
        with_service_stats(svc.id, |s| s.pass_no_nexthop += 1);
        return Err(Verdict::Pass);
    };
    Ok(Target {
        backend_id,
        node: backend.addr.v4_raw(),
        node_port: backend.port_be,
        mac: unsafe { (*nh).mac },
        snat: svc.snat_addr.v4_raw(),
        hash,
    })
}

/// Claims a free SNAT source port for a new flow: for each candidate port, `claim(reverse key, csum_port)` must
/// store the reverse entry (with that port checksum delta) only if the key is free — atomically against other
/// CPUs — so a port is never handed out twice. Ports that are service ports on the SNAT address are skipped, so a
/// reply can never be mistaken for a new client connection. Returns the port in network order.
#[inline(always)]
pub fn alloc_snat_port(
    cfg: &Config,
    t: &Target,
    p: &L4Pkt,
    mut claim: impl FnMut(FlowKeyV4, u32) -> bool,
) -> Option<u16> {
    let proto = p.key.proto;
    let min = cfg.snat_port_min as u32;
    let range = cfg.snat_port_max as u32 - min + 1;
    let start = rem(fmix(t.hash ^ 0x9e37_79b9), range);
    // The reverse entry rewrites node:NodePort → VIP:service port and SNAT port → client port.
    let (svc_port, client_port) = (p.key.dport, p.key.sport);
    let mut i = 0;
    while i < SNAT_PORT_TRIES {
        let port = ((min + rem(start + i, range)) as u16).to_be();
        i += 1;
        let skey = ServiceKey {
            addr: Addr::from_v4_raw(t.snat),
            port_be: port,
            proto,
            family: FAMILY_V4,
        };
        if SERVICES.get_ptr(skey).is_some() {
            continue;
        }
        let rkey = FlowKeyV4 {
            src: t.node,
            dst: t.snat,
            sport: t.node_port,
            dport: port,
            proto,
            _pad: [0; 3],
        };
        let csum_port = csum::add(
            csum::diff16(t.node_port, svc_port),
            csum::diff16(port, client_port),
        );
        if claim(rkey, csum_port) {
            return Some(port);
        }
    }
    None
}

/// Puts a flow event on the sync ring buffer; a full buffer only costs a counter (the agent's periodic refresh
/// carries the flow to the peers later).
#[inline(always)]
pub fn publish(kind: u8, key: &FlowKeyV4, fl: &FlowV4, rev: Option<&FlowV4>) {
    let Some(mut e) = FLOW_EVENTS.reserve::<FlowEvent>(0) else {
        count(stat::SYNC_EVENTS_LOST);
        return;
    };
    let p = e.as_mut_ptr();
    // SAFETY: `p` points at a reserved, exclusively owned ring-buffer slot of the right size; every field is
    // written before submit.
    unsafe {
        (*p).kind = kind;
        (*p)._pad = [0; 7];
        (*p).key = *key;
        (*p).fwd = *fl;
        (*p).rev = match rev {
            Some(r) => *r,
            None => FlowV4::default(),
        };
    }
    e.submit(0);
}

/// Byte-wise MAC comparison without `memcmp` (not available to BPF programs).
#[inline(always)]
fn same_mac(a: &[u8; 6], b: &[u8; 6]) -> bool {
    (a[0] ^ b[0]) | (a[1] ^ b[1]) | (a[2] ^ b[2]) | (a[3] ^ b[3]) | (a[4] ^ b[4]) | (a[5] ^ b[5])
        == 0
}

/// Updates a flow entry's timestamp (at most once a second, to spare the shared cache line) and TCP state.
/// Returns whether this packet closed the connection: a RST, or a FIN when the other direction already sent one.
#[inline(always)]
fn track(
    cfg: &Config,
    key: &FlowKeyV4,
    fl: &mut FlowV4,
    proto: u8,
    tcp_flags: u8,
    now: u64,
) -> bool {
    if now.wrapping_sub(fl.last_seen_ns) > NS_PER_S {
        fl.last_seen_ns = now;
        fl.flags &= !FLOW_F_SYNCED;
    }
    if proto != PROTO_TCP || tcp_flags & (TCP_FIN | TCP_RST) == 0 {
        return false;
    }
    let Some(bit) = close_bit(fl, tcp_flags, now) else {
        return false;
    };
    if cfg.flags & CFG_F_SYNC_EVENTS != 0 {
        publish(FLOW_EV_CLOSE, key, fl, None);
    }
    let Some(p) = FLOWS_V4.get_ptr_mut(fl.partner_key(proto)) else {
        // The other direction is gone (evicted, or a peer's flow without it): nothing else will close it.
        return true;
    };
    let partner = unsafe { &mut *p };
    if bit == FLOW_F_RST {
        // A reset ends both directions; the other side may never send again.
        partner.flags |= FLOW_F_RST;
        partner.timeout_s = TCP_CLOSING_TIMEOUT_S;
        return true;
    }
    partner.flags & (FLOW_F_FIN | FLOW_F_RST) != 0
}

/// Records a FIN or RST (from `tcp_flags`) on an entry the first time one arrives in its direction: the flag
/// bit, the service's closed-flow counter, and the closing timeout. Returns the bit that was newly set.
#[inline(always)]
pub fn close_bit(fl: &mut FlowV4, tcp_flags: u8, now: u64) -> Option<u8> {
    let bit = if tcp_flags & TCP_RST != 0 {
        FLOW_F_RST
    } else if tcp_flags & TCP_FIN != 0 {
        FLOW_F_FIN
    } else {
        return None;
    };
    if fl.flags & bit != 0 {
        return None;
    }
    if fl.flags & (FLOW_F_FIN | FLOW_F_RST) == 0 {
        with_service_stats(fl.svc_id, |s| s.closed_flows += 1);
    }
    fl.flags |= bit;
    fl.last_seen_ns = now;
    if fl.timeout_s == 0 || fl.timeout_s > TCP_CLOSING_TIMEOUT_S {
        fl.timeout_s = TCP_CLOSING_TIMEOUT_S;
    }
    Some(bit)
}

/// Whether a forward entry has been idle past its timeout, in both directions (a one-way stream keeps
/// its flow alive through either entry).
#[inline(always)]
fn expired(fl: &FlowV4, proto: u8, now: u64) -> bool {
    if !fl.idle(now) {
        return false;
    }
    match FLOWS_V4.get_ptr(fl.partner_key(proto)) {
        Some(p) => unsafe { &*p }.idle(now),
        None => true,
    }
}

/// Applies a flow's rewrite to the packet: MACs, addresses, ports, checksums.
#[inline(always)]
pub fn rewrite<C: Ctx>(c: &C, p: &L4Pkt, fl: &FlowV4) -> Verdict {
    unsafe {
        (*p.eth).src = (*p.eth).dst;
        (*p.eth).dst = fl.mac;
        (*p.ip).src = fl.new_src;
        (*p.ip).dst = fl.new_dst;
        (*p.ip).check = csum::apply((*p.ip).check, fl.csum_addr);
        (*p.ports).sport = fl.new_sport;
        (*p.ports).dport = fl.new_dport;
    }
    let (csum_p, csum_off) = p.csum();
    c.l4_csum(
        csum_off,
        csum_p,
        fl.csum_addr,
        fl.csum_port,
        p.key.proto == PROTO_UDP,
    );
    Verdict::Tx
}

/// ICMP: errors about one of our flows are translated (outer and inner headers) and sent the way the flow
/// goes; everything else (echo, errors about other traffic) is the kernel's. The message ends with the IP packet
/// (`end`, from the IP total length): Ethernet padding after it is neither read as part of the quote nor
/// rewritten, or the ICMP checksum would be adjusted for bytes it does not cover.
#[inline(always)]
fn icmp<C: Ctx>(c: &C, eth: *mut EthHdr, ip: *mut Ipv4Hdr, l4_off: usize, end: usize) -> Verdict {
    let (Some(ih), true) = (ptr_at::<C, IcmpHdr>(c, l4_off), l4_off + ICMP_LEN <= end) else {
        count(stat::DROP_MALFORMED);
        return Verdict::Drop;
    };
    let ty = unsafe { (*ih).ty };
    if ty != ICMP_DEST_UNREACH && ty != ICMP_TIME_EXCEEDED {
        count(stat::PASS_NOT_SERVICE);
        return Verdict::Pass;
    }
    let inner_off = l4_off + ICMP_LEN;
    let il4_off = inner_off + IPV4_LEN;
    let (Some(iip), true) = (ptr_at::<C, Ipv4Hdr>(c, inner_off), il4_off + 4 <= end) else {
        count(stat::PASS_ICMP_UNKNOWN);
        return Verdict::Pass;
    };
    let iproto = unsafe { (*iip).proto };
    // Our own packets never carry options, so an inner header with options is not about our flows.
    if unsafe { (*iip).vihl } != 0x45 || (iproto != PROTO_TCP && iproto != PROTO_UDP) {
        count(stat::PASS_ICMP_UNKNOWN);
        return Verdict::Pass;
    }
    let Some(ip4) = ptr_at::<C, Ports>(c, il4_off) else {
        count(stat::PASS_ICMP_UNKNOWN);
        return Verdict::Pass;
    };
    // The inner packet is one we sent; turned around, its tuple is the key of the entry for this direction.
    let key = unsafe {
        FlowKeyV4 {
            src: (*iip).dst,
            dst: (*iip).src,
            sport: (*ip4).dport,
            dport: (*ip4).sport,
            proto: iproto,
            _pad: [0; 3],
        }
    };
    // Established flows first, then handshakes and closed connections (a host unreachable for a SYN).
    let fl = match FLOWS_V4.get_ptr(key) {
        Some(fp) => unsafe { *fp },
        None => match TRANSIENT_V4.get_ptr(key) {
            Some(tp) if iproto == PROTO_TCP => unsafe { (*tp).flow },
            _ => {
                count(stat::PASS_ICMP_UNKNOWN);
                return Verdict::Pass;
            }
        },
    };
    unsafe {
        // Outer header: from us, to the far side of the flow.
        let d_outer = csum::add(
            csum::diff32((*ip).src, fl.new_src),
            csum::diff32((*ip).dst, fl.new_dst),
        );
        (*ip).src = fl.new_src;
        (*ip).dst = fl.new_dst;
        (*ip).check = csum::apply((*ip).check, d_outer);

        // Inner header: the packet as the far side sent it.
        let d_iaddr = csum::add(
            csum::diff32((*iip).src, fl.new_dst),
            csum::diff32((*iip).dst, fl.new_src),
        );
        let d_iport = csum::add(
            csum::diff16((*ip4).sport, fl.new_dport),
            csum::diff16((*ip4).dport, fl.new_sport),
        );
        (*iip).src = fl.new_dst;
        (*iip).dst = fl.new_src;
        let old_ick = (*iip).check;
        let new_ick = csum::apply(old_ick, d_iaddr);
        (*iip).check = new_ick;
        (*ip4).sport = fl.new_dport;
        (*ip4).dport = fl.new_sport;
        let mut d_icmp = csum::add(csum::add(d_iaddr, d_iport), csum::diff16(old_ick, new_ick));
        // The inner L4 checksum is there only if the error quoted enough of the packet.
        let l4_diff = csum::add(d_iaddr, d_iport);
        let udp = iproto == PROTO_UDP;
        let l4_csum_off = il4_off + if udp { UDP_CSUM_OFF } else { TCP_CSUM_OFF };
        if l4_csum_off + 2 <= end {
            if let Some(p) = ptr_at::<C, u16>(c, l4_csum_off) {
                let old = *p;
                let new = if udp {
                    csum::apply_udp(old, l4_diff)
                } else {
                    csum::apply(old, l4_diff)
                };
                *p = new;
                d_icmp = csum::add(d_icmp, csum::diff16(old, new));
            }
        }
        // ICMP header pointer re-derived: the bounds checks above may have clobbered the register.
        if let Some(ih) = ptr_at::<C, IcmpHdr>(c, l4_off) {
            (*ih).check = csum::apply((*ih).check, d_icmp);
        }
        (*eth).src = (*eth).dst;
        (*eth).dst = fl.mac;
    }
    count(stat::ICMP_TRANSLATED);
    with_service_stats(fl.svc_id, |s| s.icmp_translated += 1);
    Verdict::Tx
}

/// The data plane's settings, with defaults where user space left them unset.
#[inline(always)]
fn config() -> Config {
    match CONFIG.get(lb_common::CONFIG_INDEX) {
        Some(c) if c.snat_port_max != 0 && c.snat_port_min <= c.snat_port_max => *c,
        _ => Config::default(),
    }
}

/// `a % b` without the panic path for `b == 0` (which the verifier would reject as a dead end).
#[inline(always)]
fn rem(a: u32, b: u32) -> u32 {
    a.checked_rem(b).unwrap_or_default()
}

/// murmur3's finaliser: cheap and well mixed.
#[inline(always)]
fn fmix(mut h: u32) -> u32 {
    h ^= h >> 16;
    h = h.wrapping_mul(0x85eb_ca6b);
    h ^= h >> 13;
    h = h.wrapping_mul(0xc2b2_ae35);
    h ^= h >> 16;
    h
}

/// Hash of a flow's 5-tuple, the same on every replica with the same seed.
#[inline(always)]
pub fn flow_hash(k: &FlowKeyV4, seed: u32) -> u32 {
    let mut h = fmix(seed ^ k.src);
    h = fmix(h ^ k.dst);
    h = fmix(h ^ (((k.sport as u32) << 16) | k.dport as u32));
    fmix(h ^ k.proto as u32)
}
