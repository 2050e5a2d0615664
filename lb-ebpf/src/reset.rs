//! Connections the agent ended: their backend failed its health checks or left the service without draining
//! (`FLOW_F_END` on the forward entry). Silence would leave the client retransmitting into a dead backend until
//! its own timeout; instead, once the backend has been silent on the connection for `END_SILENCE_NS`, the
//! client's next segment comes back to it as a RST, and the connection closes here as if the client had reset
//! it. A backend still answering keeps its connection.

use core::mem::size_of;

use lb_common::{stat, Config, Flow, END_SILENCE_NS, PROTO_TCP};

use crate::{
    conntrack, csum,
    ctx::{Ctx, Verdict},
    family::Family,
    hdr::{TcpHdr, TCP_ACK, TCP_RST},
    maps::{count, with_service_stats},
    packet::L4Pkt,
};

/// Whether the backend of ended connection `fl` (its forward entry) has sent nothing on it for `END_SILENCE_NS`
/// (or its reverse entry is gone).
#[inline(always)]
pub fn backend_silent<F: Family>(fl: &Flow<F::A>, now: u64) -> bool {
    match F::flows().get_ptr(fl.partner_key(PROTO_TCP)) {
        // SAFETY: a value of the map, valid under RCU for this program run.
        Some(r) => now.wrapping_sub(unsafe { (*r).last_seen_ns }) > END_SILENCE_NS,
        None => true,
    }
}

/// A client's segment of an ended connection (`fl`, its forward entry): answered with a RST when it
/// acknowledges something (every segment of an established connection does), dropped otherwise (a RST of its
/// own); the connection closes both ways, its close published for the peers, its entries retired.
#[inline(always)]
pub fn end<C: Ctx, F: Family>(
    c: &C,
    cfg: &Config,
    p: &L4Pkt<F>,
    fl: &mut Flow<F::A>,
    now: u64,
) -> Verdict {
    let v = if p.tcp_flags & (TCP_RST | TCP_ACK) == TCP_ACK {
        reset_sender(c, p)
    } else {
        Verdict::Drop
    };
    if v == Verdict::Tx {
        count(stat::RESET_BACKEND_GONE);
        with_service_stats(fl.svc_id, |s| s.reset_backend_gone += 1);
    }
    if conntrack::track::<F>(cfg, &p.key, fl, PROTO_TCP, TCP_RST, now) {
        conntrack::retire::<F>(&p.key, fl);
    }
    v
}

/// Turns the segment into the reset a host without its connection answers with (RFC 9293, 3.10.7.1: the
/// segment carries an ACK, so the reset takes its sequence number from it and carries none): back out of the
/// interface it came in on, MACs, addresses and ports swapped. The payload stays: a RST may carry data (RFC 1122,
/// 4.2.2.12) and receivers ignore it, while cutting it would need the payload's checksum (in TC, that of a GSO
/// super-packet's offloaded one). Swapping addresses and ports leaves every checksum as it was; only the
/// sequence, acknowledgement and flags enter the TCP checksum.
#[inline(always)]
fn reset_sender<C: Ctx, F: Family>(c: &C, p: &L4Pkt<F>) -> Verdict {
    let th = p.ports as *mut TcpHdr;
    if th as usize + size_of::<TcpHdr>() > c.data_end() {
        count(stat::DROP_MALFORMED);
        return Verdict::Drop;
    }
    // SAFETY: `th` was bounds-checked above, the Ethernet and IP headers by the parser.
    let d = unsafe {
        let eth = &mut *p.eth;
        core::mem::swap(&mut eth.src, &mut eth.dst);
        F::set_addrs(p.ip, &p.key.dst, &p.key.src, 0);
        (*th).sport = p.key.dport;
        (*th).dport = p.key.sport;
        let old = u16::from_ne_bytes([(*th).doff, (*th).flags]);
        (*th).seq = p.ack_be;
        (*th).ack = 0;
        (*th).flags = TCP_RST;
        csum::add(
            csum::add(csum::diff32(p.seq_be, p.ack_be), csum::diff32(p.ack_be, 0)),
            csum::diff16(old, u16::from_ne_bytes([(*th).doff, TCP_RST])),
        )
    };
    // As in `nat::rewrite`: checked again, LLVM may have merged this with a path the verifier knows less of.
    let (csum_p, csum_off) = p.csum();
    if csum_p as usize + 2 > c.data_end() {
        count(stat::DROP_MALFORMED);
        return Verdict::Drop;
    }
    c.l4_csum(csum_off, csum_p, 0, d, false);
    Verdict::Tx
}
