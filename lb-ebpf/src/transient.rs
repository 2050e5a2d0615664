//! TCP flows outside the established state, kept in `TRANSIENT_V4` (see `lb_common::TransientV4` for why):
//! handshakes, from the client's SYN until the client acknowledges the backend's SYN-ACK, and connections after
//! they closed. `FLOWS_V4` only receives a connection whose handshake completed (the client's ACK carries the
//! SYN-ACK's sequence number + 1, which a sender of spoofed SYNs never sees), so floods and churn stay here.
//!
//! A handshake is one entry under its reverse key, holding both directions: the backend's segments find it by
//! their own key, the client's through `HANDSHAKES` (see `lb_common::handshakes`). One LRU insert per SYN instead
//! of two took 5–35 % off what a new flow costs (`bench dataplane`, docs/benchmarks.md).
// Entries go into maps by reference to map memory (scratch slots, other maps' values): a copy would put them on
// the 512-byte BPF stack, which the new-flow path already nearly fills.
#![allow(clippy::needless_borrows_for_generic_args)]

use aya_ebpf::bindings::BPF_NOEXIST;
use lb_common::{
    handshakes, stat, Config, Flow, FlowKey, Service, Transient, FLOW_F_FORWARD, FLOW_F_RST,
    FLOW_F_SYN_ACK, PROTO_TCP, TCP_CLOSING_TIMEOUT_S,
};

use crate::{
    conntrack::{close_bit, established_new},
    ctx::{Ctx, Verdict},
    family::Family,
    flow_filter,
    hdr::{TCP_ACK, TCP_RST, TCP_SYN},
    klog,
    maps::{count, with_service_stats},
    nat::{forward, rewrite, Target},
    packet::L4Pkt,
    proxy,
    snat::alloc_snat_port,
    syn_guard,
};

/// A client's SYN for `svc` without a flow of its own: claims a SNAT port and stores the handshake — or, when the
/// port the search reaches holds this client's handshake already, it is a retransmitted SYN of it — and forwards
/// the SYN to the backend.
#[inline(always)]
pub fn open<C: Ctx, F: Family>(
    c: &C,
    cfg: &Config,
    p: &L4Pkt<F>,
    svc: &Service,
    t: &Target<F::A>,
    now: u64,
) -> Verdict {
    let Some(e) = F::scratch().get_ptr_mut(0) else {
        count(stat::DROP_FLOW_INSERT);
        return Verdict::Drop;
    };
    // SAFETY (`e`): this CPU's scratch slot.
    unsafe {
        t.fill_reverse(p, svc, now, &mut (*e).flow);
        (*e).ack_be = 0;
        (*e)._pad = 0;
        t.fill_forward(p, svc, 0, now, &mut (*e).fwd);
    }
    // The client's own handshake, when the search meets it.
    let mut retransmit: *mut Transient<F::A> = core::ptr::null_mut();
    // The client's index slot: read here, written at the end of the search (one hash per SYN).
    let own_slot = slot_of::<F>(&p.key);
    // The port it names, if it names one of this search's reverse keys (they differ only in the port). Read once
    // before the search, field by field: read through the pointer inside the search, LLVM hoisted the address
    // arithmetic above the null check, which the verifier refused ("pointer arithmetic on map_value_or_null", in
    // lb-bench.o's inlining), and a copy of the whole key exceeds the stack limit.
    // SAFETY: an element of an array map. Another CPU may write it meanwhile: a mix of two keys only costs the
    // look-up below, which checks that the handshake is this client's.
    let own_port = own_slot.and_then(|s| unsafe {
        let k = &*s;
        (k.src == t.node && k.dst == t.snat && k.sport == t.node_port && k.proto == p.key.proto)
            .then_some(k.dport)
    });
    // A port counts as taken when the flow filter says an established connection may hold its reverse key in
    // FLOWS_V4 — without a lookup there: a cache miss in the large table for every port tried was most of a new
    // connection's cost, and a port skipped for a stale or shared bit is just one more try — or when a handshake
    // or closed connection holds it here (the insert fails).
    let claimed = alloc_snat_port(cfg, t, p, flow_filter::may_hold, |rkey, csum_port| {
        unsafe {
            (*e).flow.csum_port = csum_port;
            t.set_snat_port(p, &mut (*e).fwd, rkey.dport);
        }
        if F::transient()
            .insert(rkey, unsafe { &*e }, BPF_NOEXIST as u64)
            .is_ok()
        {
            return true;
        }
        // Taken — by this client's own handshake only if the client's index slot names the port. (Looking up
        // every taken port would mark the entries holding them as used, and the LRU would then keep the flood's
        // handshakes that block the search instead of recycling them.)
        if own_port != Some(rkey.dport) {
            return false;
        }
        let Some(h) = F::transient().get_ptr_mut(rkey) else {
            return false;
        };
        // SAFETY: a value of the map, valid under RCU for this program run.
        if !unsafe { &*h }.handshake_of(&p.key) {
            return false;
        }
        if unsafe { &*h }.stale(now) || unsafe { &*h }.closed() {
            // This client's earlier handshake on the port is over: the new one takes its place.
            return F::transient().insert(rkey, unsafe { &*e }, 0).is_ok();
        }
        retransmit = h;
        true
    });
    if claimed.is_none() {
        count(stat::DROP_SNAT_EXHAUSTED);
        with_service_stats(svc.id, |s| s.drop_snat_exhausted += 1);
        klog::snat_exhausted(svc.id, t.node, t.node_port, now);
        return Verdict::Drop;
    };
    let e = unsafe { &*e };
    if let Some(slot) = own_slot {
        // The handshake's reverse key, written field by field: a key built first is 40 more bytes of stack for
        // IPv6. (Another CPU may write the same slot: see `point`.)
        unsafe {
            (*slot).src = e.fwd.new_dst;
            (*slot).dst = e.fwd.new_src;
            (*slot).sport = e.fwd.new_dport;
            (*slot).dport = e.fwd.new_sport;
            (*slot).proto = PROTO_TCP;
            (*slot)._pad = [0; 3];
        }
    }
    if !retransmit.is_null() {
        // SAFETY: as above.
        let h = unsafe { &mut *retransmit };
        h.flow.last_seen_ns = now;
        return forward(c, p, &h.fwd);
    }
    syn_guard::take(cfg, now);
    count(stat::NEW_HANDSHAKES);
    with_service_stats(svc.id, |s| {
        s.handshakes += 1;
        s.rx_packets += 1;
        s.rx_bytes += p.tot as u64;
    });
    rewrite(c, p, &e.fwd)
}

/// The `HANDSHAKES` slot of a client's key (client → VIP).
#[inline(always)]
fn slot_of<F: Family>(key: &FlowKey<F::A>) -> Option<*mut FlowKey<F::A>> {
    F::handshakes().get_ptr_mut(handshakes::slot(key))
}

/// Points a client's `HANDSHAKES` slot at its handshake's reverse key.
#[inline(always)]
fn point<A: lb_common::FlowAddr>(slot: Option<*mut FlowKey<A>>, rkey: &FlowKey<A>) {
    if let Some(slot) = slot {
        // SAFETY: an element of an array map. Another CPU may write the same slot: either key is whole enough to
        // be looked up, and only an entry that is this client's handshake counts.
        unsafe { *slot = *rkey };
    }
}

/// The handshake of the client's key `key` (client → VIP), if its `HANDSHAKES` slot names one.
#[inline(always)]
pub fn find<F: Family>(key: &FlowKey<F::A>) -> Option<*mut Transient<F::A>> {
    let rkey = slot_of::<F>(key)?;
    // SAFETY (both): an element of an array map; a value of the map, valid under RCU for this program run.
    let h = F::transient().get_ptr_mut(unsafe { &*rkey })?;
    unsafe { &*h }.handshake_of(key).then_some(h)
}

/// A TCP segment that matches an entry of `TRANSIENT_V4` by its own key: a backend's segment of a handshake, or a
/// segment of a closed connection. Returns `None` when the entry no longer counts (past its time, or a SYN on a
/// closed connection's client port): the caller then treats the segment as one without a flow, so a SYN starts
/// over.
#[inline(always)]
pub fn segment<C: Ctx, F: Family>(
    c: &C,
    p: &L4Pkt<F>,
    t: &mut Transient<F::A>,
    now: u64,
) -> Option<Verdict> {
    if t.handshake() {
        // The backend's side: its SYN-ACK records what the client must acknowledge; everything is forwarded.
        if t.stale(now) {
            return None;
        }
        if !t.closed() && p.tcp_flags & (TCP_SYN | TCP_ACK) == TCP_SYN | TCP_ACK {
            if t.flow.proxy_len != 0 {
                proxy::clamp_mss(c, p, t.flow.proxy_len);
            }
            t.flow.flags |= FLOW_F_SYN_ACK;
            t.ack_be = u32::from_be(p.seq_be()).wrapping_add(1).to_be();
            // Written again, so that the client's ACK finds the handshake even if another client's SYN took the
            // slot since its own SYN (and each retransmitted SYN-ACK repairs it).
            point(slot_of::<F>(&t.flow.partner_key(PROTO_TCP)), &p.key);
        }
        t.flow.last_seen_ns = now;
        let _ = close_bit(&mut t.flow, p.tcp_flags, now);
        // No PROXY translation in a handshake: the backend cannot acknowledge a header it has not been sent.
        return Some(forward(c, p, &t.flow));
    }
    let partner = t.flow.partner_key(PROTO_TCP);
    if t.stale(now) || (p.syn() && t.flow.flags & FLOW_F_FORWARD != 0) {
        // Both entries go (the reverse one releases the SNAT port), so that a new handshake on the client port
        // is not mistaken for the closed connection.
        let _ = F::transient().remove(partner);
        let _ = F::transient().remove(p.key);
        return None;
    }
    // The last segments of a closed connection.
    track(t, p, partner, now);
    Some(proxy::forward(c, p, &mut t.flow))
}

/// A client's segment (not a SYN) of its handshake `h`, found through `HANDSHAKES`. Returns `None` when the
/// handshake is past its time.
#[inline(always)]
pub fn client_segment<C: Ctx, F: Family>(
    c: &C,
    cfg: &Config,
    p: &L4Pkt<F>,
    h: &mut Transient<F::A>,
    reopen: Option<*const Flow<F::A>>,
    now: u64,
) -> Option<Verdict> {
    if h.stale(now) {
        // Release the entry, and with it the SNAT port.
        let _ = F::transient().remove(h.fwd.partner_key(PROTO_TCP));
        return None;
    }
    if h.closed() || p.tcp_flags & TCP_RST != 0 {
        // The last segments of a reset handshake, or the client giving up: the backend must hear it.
        h.flow.last_seen_ns = now;
        let _ = close_bit(&mut h.flow, p.tcp_flags, now);
        // No PROXY translation either: before its handshake completes the client has sent nothing past where the
        // header would go.
        return Some(forward(c, p, &h.fwd));
    }
    if p.tcp_flags & TCP_ACK != 0 && h.flow.flags & FLOW_F_SYN_ACK != 0 && h.ack_be == p.ack_be() {
        return Some(promote(c, cfg, p, h, reopen, now));
    }
    // An ACK that does not acknowledge the backend's SYN-ACK (blind, spoofed, or before it), or a segment
    // without ACK: nothing a real client sends in this state.
    count(stat::DROP_HANDSHAKE);
    with_service_stats(h.flow.svc_id, |s| s.drop_handshake += 1);
    Some(Verdict::Drop)
}

/// The client completed the handshake: both directions move to `FLOWS_V4`, the connection counts as established
/// and is published for the peers' sync, and the ACK is forwarded. `h` is the handshake's entry in
/// `TRANSIENT_V4`, removed last.
#[inline(always)]
fn promote<C: Ctx, F: Family>(
    c: &C,
    cfg: &Config,
    p: &L4Pkt<F>,
    h: &mut Transient<F::A>,
    reopen: Option<*const Flow<F::A>>,
    now: u64,
) -> Verdict {
    let rkey = &h.fwd.partner_key(PROTO_TCP);
    h.fwd.last_seen_ns = now;
    h.flow.last_seen_ns = now;
    h.flow.flags &= !FLOW_F_SYN_ACK;
    // The completing ACK may carry the client's FIN already.
    let _ = close_bit(&mut h.fwd, p.tcp_flags, now);
    if let Some(old) = reopen {
        // An idle-expired connection on the same client port is replaced: release its reverse entry.
        // SAFETY: an entry of FLOWS_V4 found by this packet's lookup (map values stay valid under RCU).
        let old = unsafe { &*old }.partner_key(PROTO_TCP);
        if old != *rkey {
            let _ = F::flows().remove(old);
        }
    }
    // Reverse first: once the forward entry exists, replies must find theirs.
    if F::flows().insert(rkey, &h.flow, 0).is_err() || F::flows().insert(&p.key, &h.fwd, 0).is_err()
    {
        let _ = F::flows().remove(rkey);
        count(stat::DROP_FLOW_INSERT);
        klog::flow_insert_failed(h.fwd.svc_id, now);
        return Verdict::Drop;
    }
    // Marked once written (see `lb_common::flow_filter`); the reverse key is still held in TRANSIENT_V4 until the
    // end, so no other SYN can claim its port in between.
    flow_filter::mark(rkey);
    flow_filter::mark(&p.key);
    established_new::<F>(cfg, &p.key, &h.fwd, &h.flow);
    syn_guard::trust(cfg, p.key.src);
    let v = proxy::forward(c, p, &mut h.fwd);
    let _ = F::transient().remove(rkey);
    v
}

/// Timestamp and FIN/RST of a transient entry; a RST closes the partner too.
#[inline(always)]
fn track<F: Family>(t: &mut Transient<F::A>, p: &L4Pkt<F>, partner: FlowKey<F::A>, now: u64) {
    t.flow.last_seen_ns = now;
    if close_bit(&mut t.flow, p.tcp_flags, now) == Some(FLOW_F_RST) {
        if let Some(pp) = F::transient().get_ptr_mut(partner) {
            let pe = unsafe { &mut *pp };
            pe.flow.flags |= FLOW_F_RST;
            pe.flow.timeout_s = TCP_CLOSING_TIMEOUT_S;
        }
    }
}
