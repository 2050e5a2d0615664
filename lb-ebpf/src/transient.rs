//! TCP flows outside the established state, kept in `TRANSIENT_V4` (see `lb_common::TransientV4` for why):
//! handshakes, from the client's SYN until the client acknowledges the backend's SYN-ACK, and connections after
//! they closed. `FLOWS_V4` only receives a connection whose handshake completed (the client's ACK carries the
//! SYN-ACK's sequence number + 1, which a sender of spoofed SYNs never sees), so floods and churn stay here.
// Entries go into maps by reference to map memory (scratch slots, other maps' values): a copy would put them on
// the 512-byte BPF stack, which the new-flow path already nearly fills.
#![allow(clippy::needless_borrows_for_generic_args)]

use aya_ebpf::bindings::BPF_NOEXIST;
use lb_common::{
    stat, Config, FlowKeyV4, FlowV4, Service, TransientV4, FLOW_F_FORWARD, FLOW_F_RST,
    FLOW_F_SYN_ACK, PROTO_TCP, TCP_CLOSING_TIMEOUT_S,
};

use crate::{
    conntrack::{close_bit, established_new},
    ctx::Ctx,
    flow_filter,
    hdr::{TCP_ACK, TCP_RST, TCP_SYN},
    maps::{count, with_service_stats, FLOWS_V4, SCRATCH, TRANSIENT_V4},
    nat::{forward, rewrite, Target},
    packet::L4Pkt,
    process::Verdict,
    snat::alloc_snat_port,
    syn_guard,
};

/// Per-CPU scratch slot `i` holding `flow` as a transient entry (see `maps::SCRATCH`).
#[inline(always)]
fn scratch(i: u32, flow: &FlowV4) -> Option<*mut TransientV4> {
    let e = SCRATCH.get_ptr_mut(i)?;
    // SAFETY: this CPU's slot; nothing else runs on it while this program does.
    unsafe {
        (*e).flow = *flow;
        (*e).ack_be = 0;
        (*e)._pad = 0;
    }
    Some(e)
}

/// A client's SYN for `svc` with no flow: claims a SNAT port, stores both entries of the handshake and forwards
/// the SYN to the chosen backend.
#[inline(always)]
pub fn open<C: Ctx>(
    c: &C,
    cfg: &Config,
    p: &L4Pkt,
    svc: &Service,
    t: &Target,
    now: u64,
) -> Verdict {
    let (Some(rev), Some(fwd)) = (scratch(0, &t.reverse(p, svc, now)), SCRATCH.get_ptr_mut(1))
    else {
        count(stat::DROP_FLOW_INSERT);
        return Verdict::Drop;
    };
    // A port counts as taken when the flow filter says an established connection may hold its reverse key in
    // FLOWS_V4 — without a lookup there: a cache miss in the large table for every port tried was most of a new
    // connection's cost, and a port skipped for a stale or shared bit is just one more try — or when a handshake
    // or closed connection holds it here (the insert fails).
    // SAFETY (`rev`, `fwd`): this CPU's scratch slots.
    let port = alloc_snat_port(cfg, t, p, flow_filter::may_hold, |rkey, csum_port| {
        unsafe { (*rev).flow.csum_port = csum_port };
        TRANSIENT_V4
            .insert(rkey, unsafe { &*rev }, BPF_NOEXIST as u64)
            .is_ok()
    });
    let Some(port) = port else {
        count(stat::DROP_SNAT_EXHAUSTED);
        with_service_stats(svc.id, |s| s.drop_snat_exhausted += 1);
        return Verdict::Drop;
    };
    unsafe {
        (*fwd).flow = t.forward(p, svc, port, now);
        (*fwd).ack_be = 0;
        (*fwd)._pad = 0;
    }
    let fwd = unsafe { &*fwd };
    if TRANSIENT_V4.insert(p.key, fwd, 0).is_err() {
        let _ = TRANSIENT_V4.remove(fwd.flow.partner_key(PROTO_TCP));
        count(stat::DROP_FLOW_INSERT);
        return Verdict::Drop;
    }
    syn_guard::take(cfg, now);
    count(stat::NEW_HANDSHAKES);
    with_service_stats(svc.id, |s| {
        s.handshakes += 1;
        s.rx_packets += 1;
        s.rx_bytes += p.tot as u64;
    });
    rewrite(c, p, &fwd.flow)
}

/// A TCP segment that matches an entry of `TRANSIENT_V4`. Returns `None` when the entry no longer counts (a
/// handshake past its time, or a SYN on a closed connection's client port): the caller then treats the segment
/// as one without a flow, so a SYN starts over.
#[inline(always)]
pub fn segment<C: Ctx>(
    c: &C,
    cfg: &Config,
    p: &L4Pkt,
    t: &mut TransientV4,
    reopen: Option<*const FlowV4>,
    now: u64,
) -> Option<Verdict> {
    let partner = t.flow.partner_key(PROTO_TCP);
    if t.flow.flags & FLOW_F_FORWARD == 0 {
        // The backend's side: its SYN-ACK records what the client must acknowledge; everything is forwarded.
        if t.stale(now) {
            return None;
        }
        if !t.closed() && p.tcp_flags & (TCP_SYN | TCP_ACK) == TCP_SYN | TCP_ACK {
            t.flow.flags |= FLOW_F_SYN_ACK;
            t.ack_be = u32::from_be(p.seq_be()).wrapping_add(1).to_be();
        }
        track(t, p, partner, now);
        return Some(forward(c, p, &t.flow));
    }
    if t.stale(now) || (p.syn() && t.closed()) {
        // Release the reverse entry, and with it the SNAT port.
        let _ = TRANSIENT_V4.remove(partner);
        return None;
    }
    if t.closed() || p.syn() {
        // The last segments of a closed connection, or a retransmitted SYN of this handshake.
        track(t, p, partner, now);
        return Some(forward(c, p, &t.flow));
    }
    if p.tcp_flags & TCP_RST != 0 {
        // The client gives up: the backend must hear it.
        track(t, p, partner, now);
        return Some(forward(c, p, &t.flow));
    }
    if p.tcp_flags & TCP_ACK != 0 {
        if let Some(rp) = TRANSIENT_V4.get_ptr_mut(partner) {
            // SAFETY: a value of the map, valid until its entry is removed (promote removes it last).
            let rev = unsafe { &mut *rp };
            if rev.flow.flags & FLOW_F_SYN_ACK != 0 && rev.ack_be == p.ack_be() {
                return Some(promote(c, cfg, p, t, rev, reopen, now));
            }
        }
    }
    // An ACK that does not acknowledge the backend's SYN-ACK (blind, spoofed, or before it), or a segment
    // without ACK: nothing a real client sends in this state.
    count(stat::DROP_HANDSHAKE);
    with_service_stats(t.flow.svc_id, |s| s.drop_handshake += 1);
    Some(Verdict::Drop)
}

/// The client completed the handshake: both entries move to `FLOWS_V4`, the connection counts as established
/// and is published for the peers' sync, and the ACK is forwarded. `fwd` and `rev` are the entries in
/// `TRANSIENT_V4`, removed last.
#[inline(always)]
fn promote<C: Ctx>(
    c: &C,
    cfg: &Config,
    p: &L4Pkt,
    fwd: &mut TransientV4,
    rev: &mut TransientV4,
    reopen: Option<*const FlowV4>,
    now: u64,
) -> Verdict {
    fwd.flow.last_seen_ns = now;
    rev.flow.last_seen_ns = now;
    rev.flow.flags &= !FLOW_F_SYN_ACK;
    // The completing ACK may carry the client's FIN already.
    let _ = close_bit(&mut fwd.flow, p.tcp_flags, now);
    let rkey = fwd.flow.partner_key(PROTO_TCP);
    if let Some(old) = reopen {
        // An idle-expired connection on the same client port is replaced: release its reverse entry.
        // SAFETY: an entry of FLOWS_V4 found by this packet's lookup (map values stay valid under RCU).
        let old = unsafe { &*old }.partner_key(PROTO_TCP);
        if old != rkey {
            let _ = FLOWS_V4.remove(old);
        }
    }
    // Reverse first: once the forward entry exists, replies must find theirs.
    if FLOWS_V4.insert(rkey, &rev.flow, 0).is_err() || FLOWS_V4.insert(p.key, &fwd.flow, 0).is_err()
    {
        let _ = FLOWS_V4.remove(rkey);
        count(stat::DROP_FLOW_INSERT);
        return Verdict::Drop;
    }
    // Marked once written (see `lb_common::flow_filter`); the reverse key is still held in TRANSIENT_V4 until the
    // end, so no other SYN can claim its port in between.
    flow_filter::mark(&rkey);
    flow_filter::mark(&p.key);
    established_new(cfg, &p.key, &fwd.flow, &rev.flow);
    syn_guard::trust(cfg, p.key.src);
    let v = forward(c, p, &fwd.flow);
    let _ = TRANSIENT_V4.remove(p.key);
    let _ = TRANSIENT_V4.remove(rkey);
    v
}

/// A connection that just closed (see `conntrack::established`) leaves `FLOWS_V4`: both entries, as they are now, go
/// to `TRANSIENT_V4` for their last segments, so closed connections never push established ones out of the
/// big table.
#[inline(always)]
pub fn retire(key: &FlowKeyV4, fl: &FlowV4) {
    let pkey = fl.partner_key(key.proto);
    if let Some(pp) = FLOWS_V4.get_ptr(pkey) {
        if let Some(e) = scratch(0, unsafe { &*pp }) {
            let _ = TRANSIENT_V4.insert(pkey, unsafe { &*e }, 0);
        }
    }
    if let Some(e) = scratch(1, fl) {
        let _ = TRANSIENT_V4.insert(key, unsafe { &*e }, 0);
    }
    let _ = FLOWS_V4.remove(key);
    let _ = FLOWS_V4.remove(pkey);
}

/// Timestamp and FIN/RST of a transient entry; a RST closes the partner too.
#[inline(always)]
fn track(t: &mut TransientV4, p: &L4Pkt, partner: FlowKeyV4, now: u64) {
    t.flow.last_seen_ns = now;
    if close_bit(&mut t.flow, p.tcp_flags, now) == Some(FLOW_F_RST) {
        if let Some(pp) = TRANSIENT_V4.get_ptr_mut(partner) {
            let pe = unsafe { &mut *pp };
            pe.flow.flags |= FLOW_F_RST;
            pe.flow.timeout_s = TCP_CLOSING_TIMEOUT_S;
        }
    }
}
