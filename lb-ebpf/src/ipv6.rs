//! The IPv6 packet path (the IPv6 programs, reached by tail call from the IPv4 entry points): the fixed header and
//! a bounded walk over extension headers, then TCP and UDP through the same rules as IPv4 (`process::l4`, generic
//! over the family), and ICMPv6 errors about our flows translated both ways. See docs/design.md, "Data plane
//! rules".

use aya_ebpf::helpers::bpf_ktime_get_coarse_ns;
use lb_common::{
    klog::{MALFORMED_ETHERNET, MALFORMED_IPV6_EXT, MALFORMED_IPV6_HEADER, MALFORMED_IPV6_LENGTH},
    stat, Addr, FlowKeyV6, FlowV6, In6, Service, ServiceKey, FAMILY_V6, PROTO_ICMPV6, PROTO_TCP,
    PROTO_UDP,
};

use crate::{
    conntrack, csum,
    ctx::{ptr_at, Ctx, Verdict},
    family::V6,
    hdr::*,
    icmp::{finish, quoted_flow, Quote},
    klog,
    lb::pick_backend,
    maps::{count, FLOWS_V6, NEW_FLOW_HANDOFF, SCRATCH_V6, SERVICES, VIPS},
    nat::{egress, Target},
    packet::L4Pkt,
    process::{config, l4, open_handshake, reopen_of},
};

/// Extension headers walked before the packet goes to the kernel instead.
const MAX_EXT_HEADERS: usize = 3;

/// Processes one IPv6 frame (its EtherType and destination MAC were checked by the IPv4 program).
#[inline(always)]
pub fn process6<C: Ctx>(c: &C) -> Verdict {
    let Some(eth) = ptr_at::<C, EthHdr>(c, 0) else {
        return malformed(c, MALFORMED_ETHERNET);
    };
    // SAFETY (all header dereferences below): pointers come from `ptr_at`, which checked the bounds.
    let Some(ip) = ptr_at::<C, Ipv6Hdr>(c, ETH_LEN) else {
        return malformed(c, MALFORMED_IPV6_HEADER);
    };
    if unsafe { *(ip as *const u8) } >> 4 != 6 {
        return malformed(c, MALFORMED_IPV6_HEADER);
    }
    let tot = IPV6_LEN + u16::from_be(unsafe { (*ip).payload_len }) as usize;
    // Trailing bytes after the payload are link padding and allowed; a length beyond the frame is not.
    if tot + ETH_LEN > c.packet_len() {
        return malformed(c, MALFORMED_IPV6_LENGTH);
    }
    // Extension headers are walked, not changed: only the addresses of the fixed header are rewritten, which
    // none of hop-by-hop, routing (with no segments left) or destination options covers.
    let mut nh = unsafe { (*ip).nexthdr };
    let mut off = ETH_LEN + IPV6_LEN;
    let mut i = 0;
    while i < MAX_EXT_HEADERS && (nh == IPV6_HOPOPTS || nh == IPV6_ROUTING || nh == IPV6_DSTOPTS) {
        let Some(x) = ptr_at::<C, Ipv6ExtHdr>(c, off) else {
            return malformed(c, MALFORMED_IPV6_EXT);
        };
        if nh == IPV6_ROUTING && unsafe { (*x).segments_left } != 0 {
            // The destination is not the final one: the kernel's business.
            count(stat::PASS_IPV6_EXT);
            return Verdict::Pass;
        }
        nh = unsafe { (*x).nexthdr };
        off += (unsafe { (*x).len } as usize + 1) * 8;
        i += 1;
    }
    if i > 0 {
        count(stat::IPV6_EXT_HEADERS);
    }
    if off > ETH_LEN + tot {
        return malformed(c, MALFORMED_IPV6_EXT);
    }
    let hl = off - ETH_LEN;
    match nh {
        PROTO_TCP => {
            let Some(tcp) = ptr_at::<C, TcpHdr>(c, off) else {
                return malformed(c, lb_common::klog::MALFORMED_TCP);
            };
            let doff = (unsafe { (*tcp).doff } >> 4) as usize * 4;
            if doff < TCP_LEN || hl + doff > tot {
                return malformed(c, lb_common::klog::MALFORMED_TCP);
            }
            l4_frame(c, ip, tcp as *mut Ports, tot as u32, PROTO_TCP as u32)
        }
        PROTO_UDP => {
            let Some(udp) = ptr_at::<C, UdpHdr>(c, off) else {
                return malformed(c, lb_common::klog::MALFORMED_UDP);
            };
            if hl + UDP_LEN > tot {
                return malformed(c, lb_common::klog::MALFORMED_UDP);
            }
            if unsafe { (*udp).check } == 0 {
                // Mandatory in IPv6 (RFC 8200 §8.1): an incremental update of a missing checksum cannot make one.
                return no_checksum(&flow_key6(ip, udp as *mut Ports, PROTO_UDP));
            }
            l4_frame(c, ip, udp as *mut Ports, tot as u32, PROTO_UDP as u32)
        }
        PROTO_ICMPV6 => translate6(c, eth, ip, off, ETH_LEN + tot),
        IPV6_FRAGMENT => {
            // As IPv4: fragments to our addresses are dropped (clients use PMTUD, which the ICMPv6 translation
            // keeps working), other fragments are the kernel's.
            if VIPS
                .get_ptr(Addr::from_v6_raw(unsafe { (*ip).dst }))
                .is_some()
            {
                count(stat::DROP_FRAGMENT);
                Verdict::Drop
            } else {
                count(stat::PASS_FRAGMENT);
                Verdict::Pass
            }
        }
        IPV6_HOPOPTS | IPV6_ROUTING | IPV6_DSTOPTS | IPV6_AH | IPV6_ESP | IPV6_MOBILITY => {
            // A chain longer than the walk, or a header it does not walk.
            count(stat::PASS_IPV6_EXT);
            Verdict::Pass
        }
        _ => {
            count(stat::PASS_NOT_SERVICE);
            Verdict::Pass
        }
    }
}

/// Authentication header.
const IPV6_AH: u8 = 51;
/// Encapsulating security payload.
const IPV6_ESP: u8 = 50;
/// Mobility header.
const IPV6_MOBILITY: u8 = 135;

/// TCP and UDP in a call frame of their own: the parser's state is not live across them, and the packet's
/// `L4Pkt` (its key is 40 bytes) is built here, not held in the parser's frame. The protocol is an argument of its
/// own, a constant at each call site, so that the verifier knows which header `ports` is: packed into another
/// argument, kernel 6.1's verifier lost it and followed UDP into the TCP header's reads. (The Ethernet header is
/// taken again here: a BPF call takes 5 arguments at most.)
#[inline(never)]
fn l4_frame<C: Ctx>(c: &C, ip: *mut Ipv6Hdr, ports: *mut Ports, tot: u32, proto: u32) -> Verdict {
    let Some(eth) = ptr_at::<C, EthHdr>(c, 0) else {
        return malformed(c, MALFORMED_ETHERNET);
    };
    let proto = proto as u8;
    // SAFETY: the parser bounds-checked the headers (the whole TCP header for TCP).
    let p = unsafe {
        if proto == PROTO_TCP {
            let key = flow_key6(ip, ports, PROTO_TCP);
            L4Pkt::<V6>::new(eth, ip, ports, ports as *mut TcpHdr, key, tot as u16)
        } else {
            let key = flow_key6(ip, ports, PROTO_UDP);
            L4Pkt::<V6>::new(eth, ip, ports, core::ptr::null_mut(), key, tot as u16)
        }
    };
    l4(c, &config(), &p)
}

/// The new-flow program's logic (`lb_xdp6_new`, `lb_tc6_new`): the packet the IPv6 program handed over (see
/// `maps::NEW_FLOW_HANDOFF`) opens a flow for its service. Its headers are taken again at the handed offset
/// (checked again: the verifier knows nothing of the other program), its service and the entry it releases
/// looked up again.
// Keys go to the map helpers by reference: a copy would take 40 bytes of the BPF stack.
#[allow(clippy::needless_borrows_for_generic_args)]
#[inline(always)]
pub fn new_flow6<C: Ctx>(c: &C) -> Verdict {
    let Some(h) = NEW_FLOW_HANDOFF.get(0) else {
        count(stat::PASS_NOT_SERVICE);
        return Verdict::Pass;
    };
    // Read whole before the lookups below: the slot's pointer is then not live (spilled) across them.
    let (off, proto, tot, reopen) = (h.l4_off as usize, h.proto, h.tot, h.reopen != 0);
    // The parser walked at most `MAX_EXT_HEADERS` headers of at most 2 KiB each.
    if off > ETH_LEN + IPV6_LEN + MAX_EXT_HEADERS * 2048 {
        return malformed(c, MALFORMED_IPV6_EXT);
    }
    let (Some(eth), Some(ip)) = (ptr_at::<C, EthHdr>(c, 0), ptr_at::<C, Ipv6Hdr>(c, ETH_LEN))
    else {
        return malformed(c, MALFORMED_IPV6_HEADER);
    };
    // The packet built in each protocol's branch: the TCP header is read only where the verifier knows it is one.
    // SAFETY: bounds-checked in the branch.
    let p = if proto == PROTO_TCP {
        let Some(tcp) = ptr_at::<C, TcpHdr>(c, off) else {
            return malformed(c, lb_common::klog::MALFORMED_TCP);
        };
        let ports = tcp as *mut Ports;
        unsafe { L4Pkt::<V6>::new(eth, ip, ports, tcp, flow_key6(ip, ports, PROTO_TCP), tot) }
    } else {
        let Some(udp) = ptr_at::<C, UdpHdr>(c, off) else {
            return malformed(c, lb_common::klog::MALFORMED_UDP);
        };
        let ports = udp as *mut Ports;
        let key = flow_key6(ip, ports, PROTO_UDP);
        unsafe { L4Pkt::<V6>::new(eth, ip, ports, core::ptr::null_mut(), key, tot) }
    };
    let svc = service_frame(&p);
    if svc.is_null() {
        count(stat::PASS_NOT_SERVICE);
        return Verdict::Pass;
    }
    let reopen = if reopen {
        FLOWS_V6.get_ptr(&p.key).unwrap_or_default()
    } else {
        core::ptr::null()
    };
    // SAFETY: a value of the map, valid under RCU for this program run.
    let svc = unsafe { &*svc };
    // The backend, then the entries, in two call frames side by side under this one (each reads the settings
    // itself): inlined, the new-flow path took all of the 512-byte stack.
    // The target lives in scratch slot 3, not on this frame (48 bytes).
    let Some(t) = SCRATCH_V6.get_ptr_mut(3) else {
        count(stat::DROP_FLOW_INSERT);
        return Verdict::Drop;
    };
    let t = t as *mut Target<In6>;
    if let Err(v) = pick_backend_frame(&p, svc, t, c.ingress_ifindex()) {
        return v;
    }
    // SAFETY: this CPU's slot (larger than a target, as aligned), written by `pick_backend_frame`.
    let t = unsafe { &*t };
    if p.is_tcp() {
        handshake_frame(c, &p, svc, t, reopen)
    } else {
        udp_flow_frame(c, &p, svc, t, reopen)
    }
}

/// The packet's service (null if none), in a call frame of its own: its key (20 bytes) stays off the new-flow
/// program's main frame, which holds the `L4Pkt` under everything.
#[inline(never)]
fn service_frame(p: &L4Pkt<V6>) -> *const Service {
    let skey = ServiceKey {
        addr: Addr::from_v6_raw(p.key.dst),
        port_be: p.key.dport,
        proto: p.key.proto,
        family: FAMILY_V6,
    };
    SERVICES.get_ptr(skey).unwrap_or_default()
}

/// [`pick_backend`] in a call frame of its own; the target is written to `t` when it returns `Ok`.
#[inline(never)]
fn pick_backend_frame(
    p: &L4Pkt<V6>,
    svc: &Service,
    t: *mut Target<In6>,
    ingress: u32,
) -> Result<(), Verdict> {
    // SAFETY: `t` is the caller's scratch slot, written whole.
    pick_backend(&config(), p, svc, ingress).map(|v| unsafe { t.write(v) })
}

/// [`open_handshake`] in a call frame of its own.
#[inline(never)]
fn handshake_frame<C: Ctx>(
    c: &C,
    p: &L4Pkt<V6>,
    svc: &Service,
    t: &Target<In6>,
    reopen: *const FlowV6,
) -> Verdict {
    open_handshake(c, &config(), p, svc, t, reopen, unsafe {
        bpf_ktime_get_coarse_ns()
    })
}

/// [`conntrack::open`] in a call frame of its own.
#[inline(never)]
fn udp_flow_frame<C: Ctx>(
    c: &C,
    p: &L4Pkt<V6>,
    svc: &Service,
    t: &Target<In6>,
    reopen: *const FlowV6,
) -> Verdict {
    conntrack::open(c, &config(), p, svc, t, reopen_of(reopen), unsafe {
        bpf_ktime_get_coarse_ns()
    })
}

#[inline(always)]
fn malformed<C: Ctx>(c: &C, why: u8) -> Verdict {
    count(stat::DROP_MALFORMED);
    klog::malformed(why, c.packet_len());
    Verdict::Drop
}

/// A UDP datagram without checksum: dropped if it belongs to a flow or a service, the kernel's otherwise.
#[inline(always)]
fn no_checksum(key: &FlowKeyV6) -> Verdict {
    let skey = ServiceKey {
        addr: Addr::from_v6_raw(key.dst),
        port_be: key.dport,
        proto: PROTO_UDP,
        family: FAMILY_V6,
    };
    if FLOWS_V6.get_ptr(key).is_some() || SERVICES.get_ptr(skey).is_some() {
        count(stat::DROP_UDP6_NO_CHECKSUM);
        return Verdict::Drop;
    }
    count(stat::PASS_NOT_SERVICE);
    Verdict::Pass
}

#[inline(always)]
fn flow_key6(ip: *mut Ipv6Hdr, ports: *mut Ports, proto: u8) -> FlowKeyV6 {
    // Zeroed whole, then filled: a literal's three-byte `_pad` became a call to `memset` (a 32-byte frame on 6.1's
    // count) in the established path's frame.
    let mut k = FlowKeyV6::default();
    // SAFETY: both pointers were bounds-checked by the caller.
    unsafe {
        k.src = (*ip).src;
        k.dst = (*ip).dst;
        k.sport = (*ports).sport;
        k.dport = (*ports).dport;
    }
    k.proto = proto;
    k
}

/// ICMPv6: neighbour discovery, router messages and echo are the kernel's; errors about one of our flows
/// (destination unreachable, packet too big, time exceeded) are translated — outer and inner addresses, inner
/// ports and L4 checksum, and the ICMPv6 checksum, which also covers the outer addresses through the pseudo-header
/// — and sent the way the flow goes. The message ends with the IPv6 payload (`end`).
// Keys go to the map helpers by reference: a copy would take 40 bytes of the BPF stack.
#[allow(clippy::needless_borrows_for_generic_args)]
#[inline(never)]
fn translate6<C: Ctx>(
    c: &C,
    eth: *mut EthHdr,
    ip: *mut Ipv6Hdr,
    l4_off: usize,
    end: usize,
) -> Verdict {
    let (Some(ih), true) = (ptr_at::<C, IcmpHdr>(c, l4_off), l4_off + ICMP_LEN <= end) else {
        return malformed(c, lb_common::klog::MALFORMED_ICMPV6);
    };
    let ty = unsafe { (*ih).ty };
    if ty == ICMPV6_ECHO_REQUEST
        || ty == ICMPV6_ECHO_REPLY
        || (ICMPV6_ND_FIRST..=ICMPV6_ND_LAST).contains(&ty)
    {
        count(stat::PASS_NOT_SERVICE);
        return Verdict::Pass;
    }
    if ty != ICMPV6_DEST_UNREACH && ty != ICMPV6_PKT_TOOBIG && ty != ICMPV6_TIME_EXCEEDED {
        count(stat::PASS_ICMP_UNKNOWN);
        return Verdict::Pass;
    }
    let inner_off = l4_off + ICMP_LEN;
    let il4_off = inner_off + IPV6_LEN;
    let (Some(iip), true) = (ptr_at::<C, Ipv6Hdr>(c, inner_off), il4_off + 4 <= end) else {
        count(stat::PASS_ICMP_UNKNOWN);
        return Verdict::Pass;
    };
    let iproto = unsafe { (*iip).nexthdr };
    // Quoted extension headers are not walked: the packets we rewrite that carry them are rare.
    if iproto != PROTO_TCP && iproto != PROTO_UDP {
        count(stat::PASS_ICMP_UNKNOWN);
        return Verdict::Pass;
    }
    let Some(ip4) = ptr_at::<C, Ports>(c, il4_off) else {
        count(stat::PASS_ICMP_UNKNOWN);
        return Verdict::Pass;
    };
    // The inner packet is one we sent; turned around, its tuple is the key of the entry for this direction.
    let key = unsafe {
        FlowKeyV6 {
            src: (*iip).dst,
            dst: (*iip).src,
            sport: (*ip4).dport,
            dport: (*ip4).sport,
            proto: iproto,
            _pad: [0; 3],
        }
    };
    let Some(fl) = quoted_flow::<V6>(&key) else {
        count(stat::PASS_ICMP_UNKNOWN);
        return Verdict::Pass;
    };
    // SAFETY: a map value, valid under RCU for this program run.
    let Ok(out) = egress(unsafe { (*fl).egress }) else {
        return Verdict::Pass;
    };
    // SAFETY: a map value, valid under RCU for this program run; packet pointers bounds-checked above.
    unsafe {
        let fl = &*fl;
        // Outer header: from us, to the far side of the flow (in the ICMPv6 checksum's pseudo-header).
        let d_outer = csum::add(
            set_addr(&raw mut (*ip).src, &fl.new_src),
            set_addr(&raw mut (*ip).dst, &fl.new_dst),
        );
        // Inner header: the packet as the far side sent it.
        let d_iaddr = csum::add(
            set_addr(&raw mut (*iip).src, &fl.new_dst),
            set_addr(&raw mut (*iip).dst, &fl.new_src),
        );
        let q = Quote {
            l4_off,
            il4_off,
            end,
            udp: iproto == PROTO_UDP,
            out,
        };
        finish(c, eth, ip4, q, fl, d_iaddr, d_outer)
    }
}

/// Writes address `new` over `*a` one word at a time and returns the checksum delta: each word's diff is taken
/// before the next word is loaded, so at most two words are live (all of them at once were spilled to the stack).
///
/// # Safety
/// `a` must point into a bounds-checked header; `new` into map memory.
#[inline(always)]
unsafe fn set_addr(a: *mut In6, new: &In6) -> u32 {
    let mut d = 0;
    for (i, &n) in new.iter().enumerate() {
        // SAFETY: as the function's.
        unsafe {
            d = csum::add(d, csum::diff32((*a)[i], n));
            (*a)[i] = n;
        }
    }
    d
}
