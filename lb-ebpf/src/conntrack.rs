//! Connection tracking in `FLOWS_V4`: a packet of an established flow is counted, timestamped, and its FIN or
//! RST recorded; a connection closed both ways leaves for `TRANSIENT_V4`; new flows are published for the HA
//! peers' sync.

use aya_ebpf::bindings::BPF_NOEXIST;
use lb_common::{
    stat, Config, FlowEventV4, FlowKeyV4, FlowV4, Service, TransientV4, CFG_F_SYNC_EVENTS,
    FLOW_EV_CLOSE, FLOW_EV_NEW, FLOW_F_FIN, FLOW_F_RST, FLOW_F_SYNCED, PROTO_TCP,
    TCP_CLOSING_TIMEOUT_S,
};

use crate::{
    ctx::{Ctx, Verdict},
    hdr::{TCP_FIN, TCP_RST},
    klog,
    maps::{count, with_service_stats, FLOWS_V4, FLOW_EVENTS, SCRATCH, TRANSIENT_V4},
    nat::{forward, Target},
    packet::L4Pkt,
    snat::alloc_snat_port,
};

const NS_PER_S: u64 = 1_000_000_000;

/// A new UDP flow for `svc` to `t`: claims a SNAT port with the reverse entry, stores the forward one, publishes
/// the flow and forwards the datagram. `reopen` is the idle-expired flow this client port had before.
// New entries go into the map by reference to their scratch slot: a copy would land on the BPF stack.
#[allow(clippy::needless_borrows_for_generic_args)]
#[inline(always)]
pub fn open<C: Ctx>(
    c: &C,
    cfg: &Config,
    p: &L4Pkt,
    svc: &Service,
    t: &Target,
    reopen: Option<*const FlowV4>,
    now: u64,
) -> Verdict {
    let (key, proto) = (p.key, p.key.proto);
    // Both entries are built in per-CPU scratch space: on the stack they would push the program past what older
    // kernels' verifiers accept (see `maps::SCRATCH`).
    let (Some(rs), Some(fs)) = (SCRATCH.get_ptr_mut(0), SCRATCH.get_ptr_mut(1)) else {
        count(stat::DROP_FLOW_INSERT);
        return Verdict::Drop;
    };
    // SAFETY (`rs`, `fs`): this CPU's scratch slots; nothing else runs on this CPU meanwhile.
    unsafe { (*rs).flow = t.reverse(p, svc, now) };
    // UDP entries are not in the flow filter: the claim itself (an insert that fails on a held key) decides.
    let Some(snat_port) = alloc_snat_port(
        cfg,
        t,
        p,
        |_| false,
        |rkey, csum_port| {
            unsafe { (*rs).flow.csum_port = csum_port };
            FLOWS_V4
                .insert(rkey, unsafe { &(*rs).flow }, BPF_NOEXIST as u64)
                .is_ok()
        },
    ) else {
        count(stat::DROP_SNAT_EXHAUSTED);
        with_service_stats(svc.id, |s| s.drop_snat_exhausted += 1);
        klog::snat_exhausted(svc.id, t.node, t.node_port, now);
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
        klog::flow_insert_failed(svc.id, now);
        return Verdict::Drop;
    }
    established_new(cfg, &key, fwd, rev);
    forward(c, p, fwd)
}

/// A packet of an established flow (or of a reply direction, which follows whatever state exists): counted,
/// tracked, rewritten. A connection that this packet closes (RST, or the second FIN) leaves `FLOWS_V4` for
/// `TRANSIENT_V4`, where its last segments still find it.
#[inline(always)]
pub fn established<C: Ctx>(c: &C, cfg: &Config, p: &L4Pkt, fl: &mut FlowV4, now: u64) -> Verdict {
    let closed = track(cfg, &p.key, fl, p.key.proto, p.tcp_flags, now);
    let v = forward(c, p, fl);
    if closed {
        retire(&p.key, fl);
    }
    v
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

/// Puts a flow event on the sync ring buffer; a full buffer only costs a counter (the agent's periodic refresh
/// carries the flow to the peers later).
#[inline(always)]
pub fn publish(kind: u8, key: &FlowKeyV4, fl: &FlowV4, rev: Option<&FlowV4>) {
    let Some(mut e) = FLOW_EVENTS.reserve::<FlowEventV4>(0) else {
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
    fl.close(bit, now);
    Some(bit)
}

/// Whether a forward entry's connection is idle (see `FlowV4::connection_idle`): the data plane then treats it as
/// gone.
#[inline(always)]
pub fn expired(fl: &FlowV4, proto: u8, now: u64) -> bool {
    // SAFETY: a value of the map, valid under RCU for this program run.
    fl.connection_idle(now, || {
        FLOWS_V4
            .get_ptr(fl.partner_key(proto))
            .map(|p| unsafe { &*p })
    })
}

/// Per-CPU scratch slot `i` holding `flow` as a closed connection's entry (see `maps::SCRATCH`).
#[inline(always)]
fn scratch(i: u32, flow: &FlowV4) -> Option<*mut TransientV4> {
    let e = SCRATCH.get_ptr_mut(i)?;
    // SAFETY: this CPU's slot; nothing else runs on it while this program does.
    unsafe {
        (*e).flow = *flow;
        (*e).ack_be = 0;
        (*e)._pad = 0;
        (*e).fwd = FlowV4::default();
    }
    Some(e)
}

/// A connection that just closed (see [`established`]) leaves `FLOWS_V4`: both entries, as they are now, go
/// to `TRANSIENT_V4` for their last segments, so closed connections never push established ones out of the
/// big table.
// Entries go into the map by reference to their scratch slot: a copy would land on the BPF stack.
#[allow(clippy::needless_borrows_for_generic_args)]
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
