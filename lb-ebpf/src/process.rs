//! The one story a reader follows: a frame is parsed (Ethernet, IPv4, then TCP/UDP or ICMP), and a TCP or UDP
//! packet follows its established flow, its handshake or closed connection, or opens a flow for a service. The
//! rules live beside it by concern: `conntrack` (established flows), `transient` (handshakes and closed
//! connections), `lb` (service, source ranges, Maglev), `snat`, `nat` (the rewrite), `icmp`. See docs/design.md, "Data
//! plane rules".

use aya_ebpf::helpers::bpf_ktime_get_coarse_ns;
use lb_common::{
    stat, Addr, Config, Flow, FlowAddr, Service, ServiceKey, CFG_F_CHECK_DST_MAC, FLOW_F_END,
    FLOW_F_FIN, FLOW_F_FORWARD, FLOW_F_RST, PROTO_ICMP, PROTO_TCP, PROTO_UDP, SVC_F_PROXY_V2,
};

use crate::{
    conntrack,
    ctx::{ptr_at, Ctx, Verdict},
    family::{Family, V4},
    flow_filter,
    hdr::*,
    icmp, klog,
    lb::pick_backend,
    maps::{
        count, with_service_stats, CONFIG, EGRESS, INTERFACES, NEW_FLOW_HANDOFF, SERVICES, VIPS,
    },
    nat::Target,
    packet::{flow_key, L4Pkt},
    proxy, syn_guard, transient,
};

/// Processes one frame.
#[inline(always)]
pub fn process<C: Ctx>(c: &C) -> Verdict {
    let Some(eth) = ptr_at::<C, EthHdr>(c, 0) else {
        count(stat::DROP_MALFORMED);
        klog::malformed(lb_common::klog::MALFORMED_ETHERNET, c.packet_len());
        return Verdict::Drop;
    };
    // SAFETY (all header dereferences below): pointers come from `ptr_at`, which checked the bounds.
    let proto = unsafe { (*eth).proto };
    if proto != ETH_P_IP_BE && proto != ETH_P_IPV6_BE {
        count(stat::PASS_NOT_IP);
        return Verdict::Pass;
    }
    let cfg = config();
    if cfg.flags & CFG_F_CHECK_DST_MAC != 0
        && !same_mac(unsafe { &(*eth).dst }, &cfg.local_mac)
        && !interface_mac(c.ingress_ifindex(), unsafe { &(*eth).dst })
    {
        // Another replica's frame, flooded by the segment: forwarding it too would duplicate it.
        count(stat::PASS_OTHER_HOST);
        return Verdict::Pass;
    }
    if proto == ETH_P_IPV6_BE {
        return Verdict::Ipv6;
    }
    let Some(ip) = ptr_at::<C, Ipv4Hdr>(c, ETH_LEN) else {
        count(stat::DROP_MALFORMED);
        klog::malformed(lb_common::klog::MALFORMED_IPV4_HEADER, c.packet_len());
        return Verdict::Drop;
    };
    let vihl = unsafe { (*ip).vihl };
    let ihl = (vihl & 0x0f) as usize;
    if vihl >> 4 != 4 || ihl < 5 {
        count(stat::DROP_MALFORMED);
        klog::malformed(lb_common::klog::MALFORMED_IPV4_VERSION, c.packet_len());
        return Verdict::Drop;
    }
    let hl = ihl * 4;
    let tot = u16::from_be(unsafe { (*ip).tot_len }) as usize;
    // Trailing bytes after `tot` are link padding and allowed; a length beyond the frame is not.
    if tot < hl || tot + ETH_LEN > c.packet_len() {
        count(stat::DROP_MALFORMED);
        klog::malformed(lb_common::klog::MALFORMED_IPV4_LENGTH, c.packet_len());
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
    // One call site of `l4` for TCP and UDP: LLVM then emits the rules once, not once per protocol.
    let p = match unsafe { (*ip).proto } {
        PROTO_TCP => {
            let Some(tcp) = ptr_at::<C, TcpHdr>(c, l4_off) else {
                count(stat::DROP_MALFORMED);
                klog::malformed(lb_common::klog::MALFORMED_TCP, c.packet_len());
                return Verdict::Drop;
            };
            let doff = (unsafe { (*tcp).doff } >> 4) as usize * 4;
            if doff < TCP_LEN || hl + doff > tot {
                count(stat::DROP_MALFORMED);
                klog::malformed(lb_common::klog::MALFORMED_TCP, c.packet_len());
                return Verdict::Drop;
            }
            // SAFETY: bounds-checked above.
            unsafe {
                L4Pkt::<V4>::new(
                    eth,
                    ip,
                    tcp as *mut Ports,
                    tcp,
                    flow_key(ip, tcp as *mut Ports, PROTO_TCP),
                    tot as u16,
                )
            }
        }
        PROTO_UDP => {
            let Some(udp) = ptr_at::<C, UdpHdr>(c, l4_off) else {
                count(stat::DROP_MALFORMED);
                klog::malformed(lb_common::klog::MALFORMED_UDP, c.packet_len());
                return Verdict::Drop;
            };
            if hl + UDP_LEN > tot {
                count(stat::DROP_MALFORMED);
                klog::malformed(lb_common::klog::MALFORMED_UDP, c.packet_len());
                return Verdict::Drop;
            }
            // SAFETY: bounds-checked above.
            unsafe {
                L4Pkt::<V4>::new(
                    eth,
                    ip,
                    udp as *mut Ports,
                    core::ptr::null_mut(),
                    flow_key(ip, udp as *mut Ports, PROTO_UDP),
                    tot as u16,
                )
            }
        }
        PROTO_ICMP => return icmp::translate(c, eth, ip, l4_off, ETH_LEN + tot),
        _ => {
            count(stat::PASS_NOT_SERVICE);
            return Verdict::Pass;
        }
    };
    l4(c, &cfg, &p)
}

/// TCP or UDP: follow an established flow, a TCP handshake or a closed connection, or open a flow for a
/// service.
#[inline(always)]
pub(crate) fn l4<C: Ctx, F: Family>(c: &C, cfg: &Config, p: &L4Pkt<F>) -> Verdict {
    let key = &p.key;
    let proto = key.proto;
    let syn = p.syn();
    let now = unsafe { bpf_ktime_get_coarse_ns() };
    // The flow this packet's client port had before, released when a new one is made on it.
    // (The entry itself, not its partner's key: 8 bytes of stack instead of 20. Null, not an `Option`: with the
    // flow-filter branch below LLVM spilled the undefined payload of a `None` from a register never written,
    // which the verifier refuses.)
    let mut reopen: *const Flow<F::A> = core::ptr::null();
    let skey = ServiceKey {
        addr: key.dst.to_addr(),
        port_be: key.dport,
        proto,
        family: F::A::FAMILY,
    };
    // Over the new-handshake rate, a SYN for a service from an unknown source (a spoofed flood) is dropped
    // before it costs a lookup in the large tables.
    if syn && syn_guard::over_rate(cfg, now) {
        if let Some(svc) = SERVICES.get_ptr(skey) {
            if !syn_guard::trusted(key.src) {
                count(stat::DROP_SYN_RATE);
                klog::syn_guard_dropping(unsafe { (*svc).id }, key.src, now);
                with_service_stats(unsafe { (*svc).id }, |s| s.drop_syn_rate += 1);
                return Verdict::Drop;
            }
        }
    }

    // A SYN's own key is looked up only when the flow filter says a connection may hold it: for a new client
    // (nearly every SYN) that lookup would only miss, at the price of a cache miss in the large table.
    let lookup = !syn || flow_filter::may_hold(key);
    if let Some(fp) = lookup.then(|| F::flows().get_ptr_mut(key)).flatten() {
        let fl = unsafe { &mut *fp };
        let forward = fl.flags & FLOW_F_FORWARD != 0;
        // A SYN on a closing (or ended) flow opens a new connection on a reused client port; an idle-expired
        // forward entry no longer counts. Reverse entries never decide: replies follow whatever state exists.
        let closing_syn = syn && fl.flags & (FLOW_F_FIN | FLOW_F_RST | FLOW_F_END) != 0;
        if !forward || !(closing_syn || conntrack::expired::<F>(fl, proto, now)) {
            return conntrack::established(c, cfg, p, fl, now);
        }
        reopen = fp;
    }
    let svc = SERVICES.get_ptr(skey);
    // Handshakes and closed connections under this packet's own key: a backend's segment to a SNAT port, or a
    // client's segment of a closed connection (a client's SYN only when the flow filter says there may be one).
    // Other traffic — SSH to the VM, a low port on the VIP — skips the lookup.
    let own = if svc.is_some() {
        lookup
    } else {
        (cfg.snat_port_min..=cfg.snat_port_max).contains(&u16::from_be(key.dport))
    };
    if p.is_tcp() && own {
        if let Some(tp) = F::transient().get_ptr_mut(key) {
            if let Some(v) = transient::segment(c, p, unsafe { &mut *tp }, now) {
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
        // The client's handshake in progress.
        if let Some(hp) = transient::find::<F>(key) {
            if let Some(v) =
                transient::client_segment(c, cfg, p, unsafe { &mut *hp }, reopen_of(reopen), now)
            {
                return v;
            }
        }
        // Only a SYN creates a TCP flow. A stray segment (state lost, port scan, ACK flood) is dropped:
        // the kernel would answer with a RST, which kills connections a peer replica may still carry.
        count(stat::DROP_NO_FLOW);
        with_service_stats(svc.id, |s| s.drop_no_flow += 1);
        return Verdict::Drop;
    }
    if F::NEW_FLOW_PROGRAM {
        return hand_off_new_flow(p, reopen);
    }
    new_flow(c, cfg, p, svc, reopen, now)
}

/// IPv6: the new flow is opened by the new-flow program (`ipv6::new_flow6`), reached by tail call with a fresh
/// stack — the lookups' frames and the new-flow path's do not fit one 512-byte stack together with IPv6's keys.
#[inline(always)]
fn hand_off_new_flow<F: Family>(p: &L4Pkt<F>, reopen: *const Flow<F::A>) -> Verdict {
    let Some(h) = NEW_FLOW_HANDOFF.get_ptr_mut(0) else {
        count(stat::DROP_FLOW_INSERT);
        return Verdict::Drop;
    };
    // SAFETY: this CPU's slot; the tail call runs next on this CPU.
    unsafe {
        (*h).l4_off = (p.ports as usize - p.eth as usize) as u16;
        (*h).tot = p.tot;
        (*h).proto = p.key.proto;
        (*h).reopen = u8::from(!reopen.is_null());
        (*h)._pad = [0; 2];
    }
    Verdict::NewFlow
}

/// A flow for service `svc`: its backend, then a TCP handshake or a UDP flow.
#[inline(always)]
pub(crate) fn new_flow<C: Ctx, F: Family>(
    c: &C,
    cfg: &Config,
    p: &L4Pkt<F>,
    svc: &Service,
    reopen: *const Flow<F::A>,
    now: u64,
) -> Verdict {
    match pick_backend(cfg, p, svc, c.ingress_ifindex()) {
        Ok(t) => open_flow(c, cfg, p, svc, &t, reopen, now),
        Err(v) => v,
    }
}

/// A flow for service `svc` to backend `t`: a TCP handshake or a UDP flow.
#[inline(always)]
pub(crate) fn open_flow<C: Ctx, F: Family>(
    c: &C,
    cfg: &Config,
    p: &L4Pkt<F>,
    svc: &Service,
    t: &Target<F::A>,
    reopen: *const Flow<F::A>,
    now: u64,
) -> Verdict {
    if p.is_tcp() {
        return open_handshake(c, cfg, p, svc, t, reopen, now);
    }
    // A UDP flow has no handshake: it goes straight to FLOWS_V4.
    conntrack::open(c, cfg, p, svc, t, reopen_of(reopen), now)
}

/// A TCP connection for service `svc` to backend `t`: the handshake waits in TRANSIENT_V4; FLOWS_V4 gets the
/// connection when the client completes it.
// Keys go to the map helpers by reference: a copy would take 40 bytes of the BPF stack (IPv6).
#[allow(clippy::needless_borrows_for_generic_args)]
#[inline(always)]
pub(crate) fn open_handshake<C: Ctx, F: Family>(
    c: &C,
    cfg: &Config,
    p: &L4Pkt<F>,
    svc: &Service,
    t: &Target<F::A>,
    reopen: *const Flow<F::A>,
    now: u64,
) -> Verdict {
    if svc.flags & SVC_F_PROXY_V2 != 0 {
        if !C::INSERTS {
            // This hook cannot put the header in (see `ctx::Tc`); the agent never programs such a service for
            // it.
            count(stat::DROP_PROXY);
            return Verdict::Drop;
        }
        let sum = proxy::no_sack(c, p);
        proxy::apply_sum(c, p, sum);
    }
    if let Some(old) = reopen_of(reopen) {
        // The previous connection on this client port is over: its entries go now, so that the new one's
        // segments cannot follow them.
        let _ = F::flows().remove(unsafe { &*old }.partner_key(p.key.proto));
        let _ = F::flows().remove(&p.key);
    }
    transient::open(c, cfg, p, svc, t, now)
}

#[inline(always)]
pub(crate) fn reopen_of<A>(p: *const Flow<A>) -> Option<*const Flow<A>> {
    (!p.is_null()).then_some(p)
}

/// Whether `mac` is the MAC of interface `ifindex`, one the agent forwards on: a backend's reply on another
/// segment than the VIP's is addressed to it, not to the VIP's MAC.
#[inline(always)]
fn interface_mac(ifindex: u32, mac: &[u8; 6]) -> bool {
    let Some(slot) = INTERFACES.get_ptr(ifindex) else {
        return false;
    };
    // SAFETY: map values, valid under RCU for this program run.
    match EGRESS.get_ptr(unsafe { *slot }) {
        Some(e) => same_mac(unsafe { &(*e).mac }, mac),
        None => false,
    }
}

/// Byte-wise MAC comparison without `memcmp` (not available to BPF programs).
#[inline(always)]
fn same_mac(a: &[u8; 6], b: &[u8; 6]) -> bool {
    (a[0] ^ b[0]) | (a[1] ^ b[1]) | (a[2] ^ b[2]) | (a[3] ^ b[3]) | (a[4] ^ b[4]) | (a[5] ^ b[5])
        == 0
}

/// The data plane's settings, with defaults where user space left them unset.
#[inline(always)]
pub(crate) fn config() -> Config {
    match CONFIG.get(lb_common::CONFIG_INDEX) {
        Some(c) if c.snat_port_max != 0 && c.snat_port_min <= c.snat_port_max => *c,
        _ => Config::default(),
    }
}
