//! ICMP errors quoting one of our flows, translated both ways so that path-MTU discovery works through the load
//! balancer.

use lb_common::{stat, Flow, FlowKey, FlowKeyV4, PROTO_TCP, PROTO_UDP};

use crate::{
    csum,
    ctx::{ptr_at, Ctx, Verdict},
    family::{Family, V4},
    hdr::*,
    klog,
    maps::{count, with_service_stats},
    nat::{egress, send, set_macs, Out},
    transient,
};

/// ICMP: errors about one of our flows are translated (outer and inner headers) and sent the way the flow
/// goes; everything else (echo, errors about other traffic) is the kernel's. The message ends with the IP packet
/// (`end`, from the IP total length): Ethernet padding after it is neither read as part of the quote nor
/// rewritten, or the ICMP checksum would be adjusted for bytes it does not cover.
#[inline(always)]
pub(crate) fn translate<C: Ctx>(
    c: &C,
    eth: *mut EthHdr,
    ip: *mut Ipv4Hdr,
    l4_off: usize,
    end: usize,
) -> Verdict {
    let (Some(ih), true) = (ptr_at::<C, IcmpHdr>(c, l4_off), l4_off + ICMP_LEN <= end) else {
        count(stat::DROP_MALFORMED);
        klog::malformed(lb_common::klog::MALFORMED_ICMP, c.packet_len());
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
    let Some(fl) = quoted_flow::<V4>(&key) else {
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
        (*iip).src = fl.new_dst;
        (*iip).dst = fl.new_src;
        let old_ick = (*iip).check;
        let new_ick = csum::apply(old_ick, d_iaddr);
        (*iip).check = new_ick;
        // The ICMP checksum covers the inner header's checksum too.
        finish(
            c,
            eth,
            ip4,
            Quote {
                l4_off,
                il4_off,
                end,
                udp: iproto == PROTO_UDP,
                out,
            },
            fl,
            d_iaddr,
            csum::diff16(old_ick, new_ick),
        )
    }
}

/// The entry of the flow an ICMP error is about, `key` being the quoted packet turned around: an established
/// flow, else (TCP) a handshake or closed connection under the key itself, or a client's handshake through its
/// index (a host unreachable for a SYN). A reference into map memory: an IPv6 entry copied would take 72 bytes
/// of stack.
// Keys go to the map helpers by reference: a copy would take 40 bytes of the BPF stack.
#[allow(clippy::needless_borrows_for_generic_args)]
#[inline(always)]
pub(crate) fn quoted_flow<F: Family>(key: &FlowKey<F::A>) -> Option<*const Flow<F::A>> {
    if let Some(fp) = F::flows().get_ptr(key) {
        return Some(fp);
    }
    if key.proto != PROTO_TCP {
        return None;
    }
    if let Some(tp) = F::transient().get_ptr(key) {
        // SAFETY: a map value, valid under RCU for this program run.
        return Some(unsafe { &raw const (*tp).flow });
    }
    // SAFETY: as above.
    transient::find::<F>(key).map(|hp| unsafe { &raw const (*hp).fwd })
}

/// Where a translated error's parts are — its ICMP header (`l4_off`), the quoted L4 header (`il4_off`, TCP or
/// UDP), the end of the message — and its way out.
pub(crate) struct Quote {
    pub l4_off: usize,
    pub il4_off: usize,
    pub end: usize,
    pub udp: bool,
    pub out: Out,
}

/// The part of a translation both families share, once the addresses are rewritten: the quoted ports, the quoted
/// L4 checksum (if the error quoted that far) by the inner addresses' delta `d_iaddr` and the ports', the ICMP
/// checksum by all of that and `d_other` (IPv4: the inner header checksum's change; IPv6: the outer addresses',
/// which its pseudo-header covers), the MACs and the counters; the verdict sends it out by `q.out`.
///
/// # Safety
/// `eth` and `ports` must point into the bounds-checked frame.
#[inline(always)]
pub(crate) unsafe fn finish<C: Ctx, A>(
    c: &C,
    eth: *mut EthHdr,
    ports: *mut Ports,
    q: Quote,
    fl: &Flow<A>,
    d_iaddr: u32,
    d_other: u32,
) -> Verdict {
    // SAFETY: as the function's; the checksum fields are bounds-checked here.
    unsafe {
        let d_iport = csum::add(
            csum::diff16((*ports).sport, fl.new_dport),
            csum::diff16((*ports).dport, fl.new_sport),
        );
        (*ports).sport = fl.new_dport;
        (*ports).dport = fl.new_sport;
        let l4_diff = csum::add(d_iaddr, d_iport);
        let mut d_icmp = csum::add(d_other, l4_diff);
        let l4_csum_off = q.il4_off + if q.udp { UDP_CSUM_OFF } else { TCP_CSUM_OFF };
        if l4_csum_off + 2 <= q.end {
            if let Some(p) = ptr_at::<C, u16>(c, l4_csum_off) {
                let old = *p;
                let new = if q.udp {
                    csum::apply_udp(old, l4_diff)
                } else {
                    csum::apply(old, l4_diff)
                };
                *p = new;
                d_icmp = csum::add(d_icmp, csum::diff16(old, new));
            }
        }
        // ICMP header pointer re-derived: the bounds checks above may have clobbered the register.
        if let Some(ih) = ptr_at::<C, IcmpHdr>(c, q.l4_off) {
            (*ih).check = csum::apply((*ih).check, d_icmp);
        }
        set_macs(eth, &fl.mac, &q.out);
    }
    count(stat::ICMP_TRANSLATED);
    with_service_stats(fl.svc_id, |s| s.icmp_translated += 1);
    send(c, fl.egress, &q.out)
}
