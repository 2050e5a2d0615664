//! Connection tracking in `FLOWS_V4`: a packet of an established flow is counted, timestamped, and its FIN or
//! RST recorded; a connection closed both ways leaves for `TRANSIENT_V4`; new flows are published for the HA
//! peers' sync.

use aya_ebpf::bindings::BPF_NOEXIST;
use lb_common::{
    stat, Config, Flow, FlowEvent, FlowKey, Service, Transient, CFG_F_SYNC_EVENTS, FLOW_EV_CLOSE,
    FLOW_EV_NEW, FLOW_F_END, FLOW_F_FIN, FLOW_F_RST, FLOW_F_SYNCED, PROTO_TCP,
    TCP_CLOSING_TIMEOUT_S,
};

use crate::{
    ctx::{Ctx, Verdict},
    family::Family,
    hdr::{TCP_FIN, TCP_RST},
    klog,
    maps::{count, with_service_stats},
    nat::{forward, Target},
    packet::L4Pkt,
    proxy, reset,
    snat::alloc_snat_port,
};

const NS_PER_S: u64 = 1_000_000_000;

/// A new UDP flow for `svc` to `t`: claims a SNAT port with the reverse entry, stores the forward one, publishes
/// the flow and forwards the datagram. `reopen` is the idle-expired flow this client port had before.
// New entries go into the map by reference to their scratch slot: a copy would land on the BPF stack.
#[allow(clippy::needless_borrows_for_generic_args)]
#[inline(always)]
pub fn open<C: Ctx, F: Family>(
    c: &C,
    cfg: &Config,
    p: &L4Pkt<F>,
    svc: &Service,
    t: &Target<F::A>,
    reopen: Option<*const Flow<F::A>>,
    now: u64,
) -> Verdict {
    let (key, proto) = (&p.key, p.key.proto);
    // Both entries are built in per-CPU scratch space: on the stack they would push the program past what older
    // kernels' verifiers accept (see `maps::SCRATCH`).
    let (Some(rs), Some(fs)) = (F::scratch().get_ptr_mut(0), F::scratch().get_ptr_mut(1)) else {
        count(stat::DROP_FLOW_INSERT);
        return Verdict::Drop;
    };
    // SAFETY (`rs`, `fs`): this CPU's scratch slots; nothing else runs on this CPU meanwhile.
    unsafe { t.fill_reverse(p, svc, now, &mut (*rs).flow) };
    // UDP entries are not in the flow filter: the claim itself (an insert that fails on a held key) decides.
    let Some(snat_port) = alloc_snat_port(
        cfg,
        t,
        p,
        |_| false,
        |rkey, csum_port| {
            unsafe { (*rs).flow.csum_port = csum_port };
            F::flows()
                .insert(rkey, unsafe { &(*rs).flow }, BPF_NOEXIST as u64)
                .is_ok()
        },
    ) else {
        count(stat::DROP_SNAT_EXHAUSTED);
        with_service_stats(svc.id, |s| s.drop_snat_exhausted += 1);
        klog::snat_exhausted(svc.id, t.node, t.node_port, now);
        return Verdict::Drop;
    };
    unsafe { t.fill_forward(p, svc, snat_port, now, &mut (*fs).flow) };
    let (fwd, rev) = unsafe { (&(*fs).flow, &(*rs).flow) };
    let rkey = fwd.partner_key(proto);
    if let Some(old) = reopen {
        // The previous connection on this client port is over: release its reverse entry (and port).
        let _ = F::flows().remove(unsafe { &*old }.partner_key(proto));
    }
    if F::flows().insert(key, fwd, 0).is_err() {
        let _ = F::flows().remove(rkey);
        count(stat::DROP_FLOW_INSERT);
        klog::flow_insert_failed(svc.id, now);
        return Verdict::Drop;
    }
    established_new::<F>(cfg, key, fwd, rev);
    forward(c, p, fwd)
}

/// A packet of an established flow (or of a reply direction, which follows whatever state exists): counted,
/// tracked, rewritten. A connection that this packet closes (RST, or the second FIN) leaves `FLOWS_V4` for
/// `TRANSIENT_V4`, where its last segments still find it.
#[inline(always)]
pub fn established<C: Ctx, F: Family>(
    c: &C,
    cfg: &Config,
    p: &L4Pkt<F>,
    fl: &mut Flow<F::A>,
    now: u64,
) -> Verdict {
    // Only ever on a TCP connection's forward entry: its backend failed or left.
    if fl.flags & FLOW_F_END != 0 && reset::backend_silent::<F>(fl, now) {
        return reset::end(c, cfg, p, fl, now);
    }
    let closed = track::<F>(cfg, &p.key, fl, p.key.proto, p.tcp_flags, now);
    let v = proxy::forward(c, p, fl);
    if closed {
        retire::<F>(&p.key, fl);
    }
    v
}

/// Counts a flow that entered `FLOWS_V4` (a completed TCP handshake or a new UDP flow) and publishes it for the
/// peers' connection-state sync.
#[inline(always)]
pub fn established_new<F: Family>(
    cfg: &Config,
    key: &FlowKey<F::A>,
    fwd: &Flow<F::A>,
    rev: &Flow<F::A>,
) {
    count(stat::NEW_FLOWS);
    with_service_stats(fwd.svc_id, |s| s.new_flows += 1);
    if cfg.flags & CFG_F_SYNC_EVENTS != 0 {
        publish::<F>(FLOW_EV_NEW, key, fwd, Some(rev));
    }
}

/// Puts a flow event on the sync ring buffer; a full buffer only costs a counter (the agent's periodic refresh
/// carries the flow to the peers later).
#[inline(always)]
pub fn publish<F: Family>(
    kind: u8,
    key: &FlowKey<F::A>,
    fl: &Flow<F::A>,
    rev: Option<&Flow<F::A>>,
) {
    let Some(mut e) = F::flow_events().reserve::<FlowEvent<F::A>>(0) else {
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
            None => Flow::default(),
        };
    }
    e.submit(0);
}

/// Updates a flow entry's timestamp (at most once a second, to spare the shared cache line) and TCP state.
/// Returns whether this packet closed the connection: a RST, or a FIN when the other direction already sent one.
#[inline(always)]
pub fn track<F: Family>(
    cfg: &Config,
    key: &FlowKey<F::A>,
    fl: &mut Flow<F::A>,
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
        publish::<F>(FLOW_EV_CLOSE, key, fl, None);
    }
    let Some(p) = F::flows().get_ptr_mut(fl.partner_key(proto)) else {
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
pub fn close_bit<A: lb_common::FlowAddr>(fl: &mut Flow<A>, tcp_flags: u8, now: u64) -> Option<u8> {
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
pub fn expired<F: Family>(fl: &Flow<F::A>, proto: u8, now: u64) -> bool {
    // SAFETY: a value of the map, valid under RCU for this program run.
    fl.connection_idle(now, || {
        F::flows()
            .get_ptr(fl.partner_key(proto))
            .map(|p| unsafe { &*p })
    })
}

/// Per-CPU scratch slot `i` holding `flow` as a closed connection's entry (see `maps::SCRATCH`).
#[inline(always)]
fn scratch<F: Family>(i: u32, flow: &Flow<F::A>) -> Option<*mut Transient<F::A>> {
    let e = F::scratch().get_ptr_mut(i)?;
    // SAFETY: this CPU's slot; nothing else runs on it while this program does.
    unsafe {
        (*e).flow = *flow;
        (*e).ack_be = 0;
        (*e)._pad = 0;
        (*e).fwd = Flow::default();
    }
    Some(e)
}

/// A connection that just closed (see [`established`]) leaves `FLOWS_V4`: both entries, as they are now, go
/// to `TRANSIENT_V4` for their last segments, so closed connections never push established ones out of the
/// big table.
// Entries go into the map by reference to their scratch slot: a copy would land on the BPF stack.
#[allow(clippy::needless_borrows_for_generic_args)]
#[inline(always)]
pub fn retire<F: Family>(key: &FlowKey<F::A>, fl: &Flow<F::A>) {
    let pkey = fl.partner_key(key.proto);
    if let Some(pp) = F::flows().get_ptr(pkey) {
        if let Some(e) = scratch::<F>(0, unsafe { &*pp }) {
            let _ = F::transient().insert(pkey, unsafe { &*e }, 0);
        }
    }
    if let Some(e) = scratch::<F>(1, fl) {
        let _ = F::transient().insert(key, unsafe { &*e }, 0);
    }
    let _ = F::flows().remove(key);
    let _ = F::flows().remove(pkey);
}
