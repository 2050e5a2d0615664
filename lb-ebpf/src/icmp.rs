//! ICMP errors quoting one of our flows, translated both ways so that path-MTU discovery works through the load
//! balancer.

use lb_common::{stat, FlowKeyV4, PROTO_TCP, PROTO_UDP};

use crate::{
    csum,
    ctx::{ptr_at, Ctx, Verdict},
    family::V4,
    hdr::*,
    klog,
    maps::{count, with_service_stats, FLOWS_V4, TRANSIENT_V4},
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
    // Established flows first, then handshakes and closed connections (a host unreachable for a SYN): under the
    // key itself, or a client's handshake through its index.
    let fl = match FLOWS_V4.get_ptr(key) {
        Some(fp) => unsafe { *fp },
        None if iproto == PROTO_TCP => match TRANSIENT_V4.get_ptr(key) {
            Some(tp) => unsafe { (*tp).flow },
            None => match transient::find::<V4>(&key) {
                Some(hp) => unsafe { (*hp).fwd },
                None => {
                    count(stat::PASS_ICMP_UNKNOWN);
                    return Verdict::Pass;
                }
            },
        },
        None => {
            count(stat::PASS_ICMP_UNKNOWN);
            return Verdict::Pass;
        }
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
