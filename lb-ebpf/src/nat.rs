//! Full NAT: VIP:port → node:NodePort with SNAT, connection tracking, source ranges, idle timeouts and ICMP
//! error translation. See README "Data plane" for the rules this implements.

use aya_ebpf::{bindings::BPF_NOEXIST, helpers::bpf_ktime_get_coarse_ns, maps::lpm_trie::Key};
use lb_common::{
    stat, Addr, Config, FlowEvent, FlowKeyV4, FlowV4, ServiceKey, SourceRangeKey,
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
        SERVICES, SOURCE_RANGES, VIPS,
    },
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
            let flags = unsafe { (*tcp).flags };
            let csum_p = (tcp as usize + TCP_CSUM_OFF) as *mut u16;
            l4(
                c,
                &cfg,
                eth,
                ip,
                tcp as *mut Ports,
                csum_p,
                l4_off + TCP_CSUM_OFF,
                PROTO_TCP,
                flags,
                tot,
            )
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
            let csum_p = (udp as usize + UDP_CSUM_OFF) as *mut u16;
            l4(
                c,
                &cfg,
                eth,
                ip,
                udp as *mut Ports,
                csum_p,
                l4_off + UDP_CSUM_OFF,
                PROTO_UDP,
                0,
                tot,
            )
        }
        PROTO_ICMP => icmp(c, eth, ip, l4_off),
        _ => {
            count(stat::PASS_NOT_SERVICE);
            Verdict::Pass
        }
    }
}

/// TCP or UDP: follow a flow, or create one for a service.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn l4<C: Ctx>(
    c: &C,
    cfg: &Config,
    eth: *mut EthHdr,
    ip: *mut Ipv4Hdr,
    ports: *mut Ports,
    csum_p: *mut u16,
    csum_off: usize,
    proto: u8,
    tcp_flags: u8,
    tot: usize,
) -> Verdict {
    let key = unsafe {
        FlowKeyV4 {
            src: (*ip).src,
            dst: (*ip).dst,
            sport: (*ports).sport,
            dport: (*ports).dport,
            proto,
            _pad: [0; 3],
        }
    };
    let is_tcp = proto == PROTO_TCP;
    let syn = is_tcp && tcp_flags & (TCP_SYN | TCP_ACK) == TCP_SYN;
    let now = unsafe { bpf_ktime_get_coarse_ns() };
    let mut reopen: Option<FlowKeyV4> = None;

    if let Some(fp) = FLOWS_V4.get_ptr_mut(key) {
        let fl = unsafe { &mut *fp };
        let forward = fl.flags & FLOW_F_FORWARD != 0;
        // A SYN on a closing flow opens a new connection on a reused client port; an idle-expired forward
        // entry no longer counts. Reverse entries never decide: replies follow whatever state exists.
        let closing_syn = syn && fl.flags & (FLOW_F_FIN | FLOW_F_RST) != 0;
        let usable = !forward || !(closing_syn || expired(fl, proto, now));
        if usable {
            track(cfg, &key, fl, proto, tcp_flags, now);
            let fwd_dir = forward;
            let flow = *fl;
            with_service_stats(flow.svc_id, |s| {
                if fwd_dir {
                    s.rx_packets += 1;
                    s.rx_bytes += tot as u64;
                } else {
                    s.tx_packets += 1;
                    s.tx_bytes += tot as u64;
                }
            });
            return rewrite(c, eth, ip, ports, csum_p, csum_off, &flow, proto);
        }
        reopen = Some(fl.partner_key(proto));
    }

    // No usable flow: is it for a service?
    let skey = ServiceKey {
        addr: Addr::from_v4_raw(key.dst),
        port_be: key.dport,
        proto,
        family: FAMILY_V4,
    };
    let Some(svc) = SERVICES.get_ptr(skey) else {
        count(stat::PASS_NOT_SERVICE);
        return Verdict::Pass;
    };
    let svc = unsafe { *svc };
    if is_tcp && !syn {
        // Only a SYN creates a TCP flow. A stray segment (state lost, port scan, ACK flood) is dropped:
        // the kernel would answer with a RST, which kills connections a peer replica may still carry.
        count(stat::DROP_NO_FLOW);
        with_service_stats(svc.id, |s| s.drop_no_flow += 1);
        return Verdict::Drop;
    }
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
            return Verdict::Drop;
        }
    }
    if svc.table_size == 0 {
        count(stat::DROP_NO_BACKEND);
        with_service_stats(svc.id, |s| s.drop_no_backend += 1);
        return Verdict::Drop;
    }
    let hash = flow_hash(&key, cfg.hash_seed);
    let slot = svc.table_offset + rem(hash, svc.table_size);
    let Some(&backend_id) = MAGLEV.get(slot) else {
        count(stat::DROP_BAD_BACKEND);
        return Verdict::Drop;
    };
    let Some(backend) = BACKENDS.get(backend_id) else {
        count(stat::DROP_BAD_BACKEND);
        return Verdict::Drop;
    };
    if backend.family != FAMILY_V4 {
        count(stat::DROP_BAD_BACKEND);
        return Verdict::Drop;
    }
    let Some(nh) = NEXTHOPS.get_ptr(backend.addr) else {
        // The kernel gets the packet unchanged and resolves the neighbour; the agent notices the counter
        // and refreshes the table. The client retransmits.
        count(stat::PASS_NO_NEXTHOP);
        with_service_stats(svc.id, |s| s.pass_no_nexthop += 1);
        return Verdict::Pass;
    };
    let nh_mac = unsafe { (*nh).mac };
    let node = backend.addr.v4_raw();
    let node_port = backend.port_be;
    let snat = svc.snat_addr.v4_raw();

    let mut rev = FlowV4 {
        new_src: key.dst,
        new_dst: key.src,
        new_sport: key.dport,
        new_dport: key.sport,
        mac: unsafe { (*eth).src },
        flags: FLOW_F_REVERSE,
        _pad: 0,
        svc_id: svc.id,
        backend_id,
        timeout_s: svc.idle_timeout_s,
        csum_addr: csum::add(csum::diff32(node, key.dst), csum::diff32(snat, key.src)),
        csum_port: 0,
        last_seen_ns: now,
    };
    let Some(snat_port) = alloc_snat_port(cfg, hash, snat, node, node_port, proto, &mut rev) else {
        count(stat::DROP_SNAT_EXHAUSTED);
        with_service_stats(svc.id, |s| s.drop_snat_exhausted += 1);
        return Verdict::Drop;
    };
    let fwd = FlowV4 {
        new_src: snat,
        new_dst: node,
        new_sport: snat_port,
        new_dport: node_port,
        mac: nh_mac,
        flags: FLOW_F_FORWARD,
        _pad: 0,
        svc_id: svc.id,
        backend_id,
        timeout_s: svc.idle_timeout_s,
        csum_addr: csum::add(csum::diff32(key.src, snat), csum::diff32(key.dst, node)),
        csum_port: csum::add(
            csum::diff16(key.sport, snat_port),
            csum::diff16(key.dport, node_port),
        ),
        last_seen_ns: now,
    };
    let rkey = fwd.partner_key(proto);
    if let Some(old) = reopen {
        // The previous connection on this client port is over: release its reverse entry (and port).
        let _ = FLOWS_V4.remove(old);
    }
    if FLOWS_V4.insert(key, fwd, 0).is_err() {
        let _ = FLOWS_V4.remove(rkey);
        count(stat::DROP_FLOW_INSERT);
        return Verdict::Drop;
    }
    count(stat::NEW_FLOWS);
    if cfg.flags & CFG_F_SYNC_EVENTS != 0 {
        publish(FLOW_EV_NEW, &key, &fwd, Some(&rev));
    }
    with_service_stats(svc.id, |s| {
        s.new_flows += 1;
        s.rx_packets += 1;
        s.rx_bytes += tot as u64;
    });
    rewrite(c, eth, ip, ports, csum_p, csum_off, &fwd, proto)
}

/// Claims a free SNAT source port for a new flow by inserting its reverse entry with `BPF_NOEXIST` (atomic
/// against other CPUs). Ports that are service ports on the SNAT address are skipped, so a reply can never be
/// mistaken for a new client connection. Returns the port in network order.
#[inline(always)]
fn alloc_snat_port(
    cfg: &Config,
    hash: u32,
    snat: u32,
    node: u32,
    node_port: u16,
    proto: u8,
    rev: &mut FlowV4,
) -> Option<u16> {
    let min = cfg.snat_port_min as u32;
    let range = cfg.snat_port_max as u32 - min + 1;
    let start = rem(fmix(hash ^ 0x9e37_79b9), range);
    let client_port = rev.new_dport;
    let svc_port = rev.new_sport;
    let mut i = 0;
    while i < SNAT_PORT_TRIES {
        let port = ((min + rem(start + i, range)) as u16).to_be();
        i += 1;
        let skey = ServiceKey {
            addr: Addr::from_v4_raw(snat),
            port_be: port,
            proto,
            family: FAMILY_V4,
        };
        if SERVICES.get_ptr(skey).is_some() {
            continue;
        }
        let rkey = FlowKeyV4 {
            src: node,
            dst: snat,
            sport: node_port,
            dport: port,
            proto,
            _pad: [0; 3],
        };
        rev.csum_port = csum::add(
            csum::diff16(node_port, svc_port),
            csum::diff16(port, client_port),
        );
        if FLOWS_V4.insert(rkey, *rev, BPF_NOEXIST as u64).is_ok() {
            return Some(port);
        }
    }
    None
}

/// Puts a flow event on the sync ring buffer; a full buffer only costs a counter (the agent's periodic refresh
/// carries the flow to the peers later).
#[inline(always)]
fn publish(kind: u8, key: &FlowKeyV4, fl: &FlowV4, rev: Option<&FlowV4>) {
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
#[inline(always)]
fn track(cfg: &Config, key: &FlowKeyV4, fl: &mut FlowV4, proto: u8, tcp_flags: u8, now: u64) {
    if now.wrapping_sub(fl.last_seen_ns) > NS_PER_S {
        fl.last_seen_ns = now;
        fl.flags &= !FLOW_F_SYNCED;
    }
    if proto != PROTO_TCP || tcp_flags & (TCP_FIN | TCP_RST) == 0 {
        return;
    }
    let bit = if tcp_flags & TCP_RST != 0 {
        FLOW_F_RST
    } else {
        FLOW_F_FIN
    };
    if fl.flags & bit != 0 {
        return;
    }
    if fl.flags & (FLOW_F_FIN | FLOW_F_RST) == 0 {
        with_service_stats(fl.svc_id, |s| s.closed_flows += 1);
    }
    fl.flags |= bit;
    fl.last_seen_ns = now;
    if fl.timeout_s == 0 || fl.timeout_s > TCP_CLOSING_TIMEOUT_S {
        fl.timeout_s = TCP_CLOSING_TIMEOUT_S;
    }
    if cfg.flags & CFG_F_SYNC_EVENTS != 0 {
        publish(FLOW_EV_CLOSE, key, fl, None);
    }
    if bit == FLOW_F_RST {
        // A reset ends both directions; the other side may never send again.
        if let Some(p) = FLOWS_V4.get_ptr_mut(fl.partner_key(proto)) {
            let partner = unsafe { &mut *p };
            partner.flags |= FLOW_F_RST;
            partner.timeout_s = TCP_CLOSING_TIMEOUT_S;
        }
    }
}

/// Whether a forward entry has been idle past its timeout, in both directions (a one-way stream keeps
/// its flow alive through either entry).
#[inline(always)]
fn expired(fl: &FlowV4, proto: u8, now: u64) -> bool {
    if !stale(fl, now) {
        return false;
    }
    match FLOWS_V4.get_ptr(fl.partner_key(proto)) {
        Some(p) => stale(unsafe { &*p }, now),
        None => true,
    }
}

#[inline(always)]
fn stale(fl: &FlowV4, now: u64) -> bool {
    fl.timeout_s != 0 && now.saturating_sub(fl.last_seen_ns) > fl.timeout_s as u64 * NS_PER_S
}

/// Applies a flow's rewrite to the packet: MACs, addresses, ports, checksums.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn rewrite<C: Ctx>(
    c: &C,
    eth: *mut EthHdr,
    ip: *mut Ipv4Hdr,
    ports: *mut Ports,
    csum_p: *mut u16,
    csum_off: usize,
    fl: &FlowV4,
    proto: u8,
) -> Verdict {
    unsafe {
        (*eth).src = (*eth).dst;
        (*eth).dst = fl.mac;
        (*ip).src = fl.new_src;
        (*ip).dst = fl.new_dst;
        (*ip).check = csum::apply((*ip).check, fl.csum_addr);
        (*ports).sport = fl.new_sport;
        (*ports).dport = fl.new_dport;
    }
    c.l4_csum(
        csum_off,
        csum_p,
        fl.csum_addr,
        fl.csum_port,
        proto == PROTO_UDP,
    );
    Verdict::Tx
}

/// ICMP: errors about one of our flows are translated (outer and inner headers) and sent the way the flow
/// goes; everything else (echo, errors about other traffic) is the kernel's.
#[inline(always)]
fn icmp<C: Ctx>(c: &C, eth: *mut EthHdr, ip: *mut Ipv4Hdr, l4_off: usize) -> Verdict {
    let Some(ih) = ptr_at::<C, IcmpHdr>(c, l4_off) else {
        count(stat::DROP_MALFORMED);
        return Verdict::Drop;
    };
    let ty = unsafe { (*ih).ty };
    if ty != ICMP_DEST_UNREACH && ty != ICMP_TIME_EXCEEDED {
        count(stat::PASS_NOT_SERVICE);
        return Verdict::Pass;
    }
    let inner_off = l4_off + ICMP_LEN;
    let Some(iip) = ptr_at::<C, Ipv4Hdr>(c, inner_off) else {
        count(stat::PASS_ICMP_UNKNOWN);
        return Verdict::Pass;
    };
    let iproto = unsafe { (*iip).proto };
    // Our own packets never carry options, so an inner header with options is not about our flows.
    if unsafe { (*iip).vihl } != 0x45 || (iproto != PROTO_TCP && iproto != PROTO_UDP) {
        count(stat::PASS_ICMP_UNKNOWN);
        return Verdict::Pass;
    }
    let il4_off = inner_off + IPV4_LEN;
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
    let Some(fp) = FLOWS_V4.get_ptr(key) else {
        count(stat::PASS_ICMP_UNKNOWN);
        return Verdict::Pass;
    };
    let fl = unsafe { *fp };
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
        if iproto == PROTO_TCP {
            if let Some(p) = ptr_at::<C, u16>(c, il4_off + TCP_CSUM_OFF) {
                let old = *p;
                let new = csum::apply(old, l4_diff);
                *p = new;
                d_icmp = csum::add(d_icmp, csum::diff16(old, new));
            }
        } else if let Some(p) = ptr_at::<C, u16>(c, il4_off + UDP_CSUM_OFF) {
            let old = *p;
            let new = csum::apply_udp(old, l4_diff);
            *p = new;
            d_icmp = csum::add(d_icmp, csum::diff16(old, new));
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
