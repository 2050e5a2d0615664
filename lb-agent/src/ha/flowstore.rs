//! The connection-tracking table as the state sync sees it: full dumps for a (re)joining peer, and the
//! application of a peer's flow events to the local BPF maps.
//!
//! Replicas do not share ids or clocks, so an applied entry is translated: the service id is looked up by
//! (VIP, port, protocol) in the local `SERVICES` map, the next-hop MAC comes from the local `NEXTHOPS` map
//! when it knows the backend, and `last_seen_ns` is the local clock minus the age the peer sent. The backend
//! id of a synced entry is [`SYNCED_BACKEND_ID`] (it only labels flows; nothing routes by it).
//!
//! The peer's table is mirrored, closes included: a connection the peer saw close (reset, or FIN both ways)
//! leaves `FLOWS_V4` for `TRANSIENT_V4` here too, as the data plane moves it there, so that the copies hold the
//! same connections with the same timers. A new connection replaces whatever held its client port or SNAT
//! port here before (closed, idle, or itself a copy of the peer's: the peer's later records supersede its
//! earlier ones, e.g. when a resync overlaps live updates).
//!
//! A conflict is what only a split brain makes: a connection that this replica carries itself (not a synced
//! copy, neither closed nor idle) translated differently from the peer's record. The VRRP master keeps its own
//! entry, a backup takes the peer's; both count it. With the same config and hash seed the replicas choose the
//! same backend and SNAT port for a flow, so even a split brain only conflicts where configs differ.
//!
//! Records are applied a batch at a time (a sync frame's worth): reads go to the maps (or to what the batch
//! already changed), and the batch's writes and deletes reach the maps at its end, a few syscalls for all of
//! them (see [`crate::dataplane::map_batch`]).
//!
//! Both address families follow these rules, written once over `lb_common::FlowAddr`: IPv6 connections live in
//! `FLOWS_V6`/`TRANSIENT_V6` ([`Tables`]), and a batch keeps one staging area per family.

use crate::dataplane::flow_filter::FlowFilterMap;
use crate::dataplane::gc::{connections, now_ns, NS_PER_MS};
use crate::dataplane::maps::{Maps, Table};
use crate::ha::sync::{ApplyOutcome, FlowRecord, SyncEvent};
use anyhow::{Context, Result};
use lb_common::{
    Addr, Flow, FlowAddr, FlowEvent, FlowKey, In6, NextHop, Service, ServiceKey, Transient,
    FLOW_EV_CLOSE, FLOW_EV_NEW, FLOW_EV_REFRESH, FLOW_F_FIN, FLOW_F_FORWARD, FLOW_F_RST,
    FLOW_F_SYNCED, PROTO_TCP, TCP_CLOSING_TIMEOUT_S,
};
use std::collections::HashMap as StdMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// Backend id of entries written by the sync (ids are per replica).
pub const SYNCED_BACKEND_ID: u32 = u32::MAX;

/// One family's connection-tracking maps.
struct Tables<A> {
    flows: Table<FlowKey<A>, Flow<A>>,
    transient: Table<FlowKey<A>, Transient<A>>,
}

/// Handles on the data plane's maps, independent of the agent's [`Maps`].
pub struct BpfFlowStore {
    v4: Tables<u32>,
    v6: Tables<In6>,
    /// Marked for every connection written here, as the data plane marks its own (`lb_common::flow_filter`).
    filter: FlowFilterMap,
    services: Table<ServiceKey, Service>,
    nexthops: Table<Addr, NextHop>,
    /// The SYN rate guard's trusted sources: a peer's completed handshake vouches for its client here too, so
    /// after a failover the new master lets the old master's clients through a flood.
    trusted: Table<Addr, u8>,
    master: Arc<AtomicBool>,
}

/// What one batch of records changes in one family's tables, kept until the batch's end: the entries it wrote
/// (`Some`) or deleted (`None`), in the order of their last change, and what it read.
struct Batch<A> {
    seq: u64,
    flows: StdMap<FlowKey<A>, Staged<Flow<A>>>,
    transient: StdMap<FlowKey<A>, Staged<Transient<A>>>,
}

impl<A> Default for Batch<A> {
    fn default() -> Self {
        Batch {
            seq: 0,
            flows: StdMap::new(),
            transient: StdMap::new(),
        }
    }
}

/// What one batch reads and writes outside the connection tables, whatever the family.
#[derive(Default)]
struct Shared {
    services: StdMap<ServiceKey, Option<Service>>,
    nexthops: StdMap<Addr, Option<NextHop>>,
    trusted: Vec<Addr>,
}

struct Staged<V> {
    /// When the entry last changed in this batch (the maps get the changes in that order).
    seq: u64,
    /// The entry as the batch left it.
    now: Option<V>,
    /// Whether the map held the key before the batch (`None`: not looked up).
    before: Option<bool>,
}

impl BpfFlowStore {
    /// Opens second handles on the flow, service and next-hop maps. `master` says whether this replica holds the
    /// VIP (it wins conflicts).
    pub fn open(maps: &Maps, master: Arc<AtomicBool>) -> Result<Self> {
        Ok(BpfFlowStore {
            v4: Tables {
                flows: maps.flows.reopen()?,
                transient: maps.transient.reopen()?,
            },
            v6: Tables {
                flows: maps.flows_v6.reopen()?,
                transient: maps.transient_v6.reopen()?,
            },
            filter: maps.flow_filter.reopen().context("flow filter mapping")?,
            services: maps.services.reopen()?,
            nexthops: maps.nexthops.reopen()?,
            trusted: maps.trusted_sources.reopen()?,
            master,
        })
    }

    /// Every connection with both entries, of both families, as [`FLOW_EV_NEW`] records with their ages in ms.
    pub fn dump(&self) -> Result<Vec<FlowRecord>> {
        let now = now_ns();
        let v4: StdMap<_, _> = self.v4.flows.entries()?.into_iter().collect();
        let v6: StdMap<_, _> = self.v6.flows.entries()?.into_iter().collect();
        let v4 = connections(&v4, now, |_, _| true, FLOW_EV_NEW).into_iter();
        let v6 = connections(&v6, now, |_, _| true, FLOW_EV_NEW).into_iter();
        Ok(v4
            .map(|(e, age_ms)| (SyncEvent::from(e), age_ms))
            .chain(v6.map(|(e, age_ms)| (SyncEvent::from(e), age_ms)))
            .map(|(event, age_ms)| FlowRecord { event, age_ms })
            .collect())
    }

    /// Applies a peer's event that happened `age_ms` ago.
    pub fn apply<A: FlowAddr>(&mut self, ev: &FlowEvent<A>, age_ms: u32) -> Result<ApplyOutcome>
    where
        SyncEvent: From<FlowEvent<A>>,
    {
        let rec = FlowRecord {
            event: SyncEvent::from(*ev),
            age_ms,
        };
        Ok(self.apply_batch(&[rec])?[0])
    }

    /// Applies a batch of a peer's records in order; the maps see the batch's changes together at its end.
    pub fn apply_batch(&mut self, recs: &[FlowRecord]) -> Result<Vec<ApplyOutcome>> {
        let now = now_ns();
        let (mut b4, mut b6, mut sh) = (Batch::default(), Batch::default(), Shared::default());
        let mut out = Vec::with_capacity(recs.len());
        for r in recs {
            let seen = now.saturating_sub(r.age_ms as u64 * NS_PER_MS);
            out.push(match &r.event {
                SyncEvent::V4(ev) => self.apply_event(&self.v4, &mut b4, &mut sh, ev, seen, now)?,
                SyncEvent::V6(ev) => self.apply_event(&self.v6, &mut b6, &mut sh, ev, seen, now)?,
            });
        }
        commit(&mut self.v4, &self.filter, b4)?;
        commit(&mut self.v6, &self.filter, b6)?;
        let mut trusted: Vec<(Addr, u8)> = sh.trusted.into_iter().map(|a| (a, 1)).collect();
        trusted.sort_unstable_by_key(|(a, _)| a.bytes);
        trusted.dedup();
        self.trusted
            .insert_many(&trusted)
            .context("writing trusted sources")?;
        Ok(out)
    }

    fn apply_event<A: FlowAddr>(
        &self,
        t: &Tables<A>,
        b: &mut Batch<A>,
        sh: &mut Shared,
        ev: &FlowEvent<A>,
        seen: u64,
        now: u64,
    ) -> Result<ApplyOutcome> {
        Ok(match ev.kind {
            FLOW_EV_NEW | FLOW_EV_REFRESH => self.apply_connection(t, b, sh, ev, seen, now)?,
            FLOW_EV_CLOSE => apply_close(t, b, ev, seen)?,
            k => {
                // The wire format checks kinds; a peer of a newer version could still send one we lack.
                tracing::debug!(kind = k, "a synced record of an unknown kind");
                ApplyOutcome::Error
            }
        })
    }
}

/// Writes one family's changes: flow entries (reverse before forward, as the records did), marked in the flow
/// filter after the write (see `lb_common::flow_filter`), then deletions, then the transient table.
fn commit<A: FlowAddr>(t: &mut Tables<A>, filter: &FlowFilterMap, b: Batch<A>) -> Result<()> {
    let (writes, deletes) = split(b.flows);
    // Spread over the CPUs where the lists are per CPU (`Table::insert_spread`): a backup writes every connection
    // of the master here, and from one CPU it would keep only that CPU's share of the table.
    t.flows
        .insert_spread(&writes)
        .context("writing synced flows")?;
    for (k, _) in &writes {
        filter.mark(k);
    }
    t.flows
        .remove_many(&deletes)
        .context("deleting replaced flows")?;
    let (writes, deletes) = split(b.transient);
    // Likewise (a resync's thousands of closed connections would otherwise crowd one CPU's share).
    t.transient
        .insert_spread(&writes)
        .context("writing closed connections")?;
    t.transient
        .remove_many(&deletes)
        .context("deleting closed connections")?;
    Ok(())
}

/// The entry at `k`: as the batch left it, else from the map (remembered in the batch).
fn get<A: FlowAddr>(t: &Tables<A>, b: &mut Batch<A>, k: &FlowKey<A>) -> Result<Option<Flow<A>>> {
    if let Some(s) = b.flows.get(k) {
        return Ok(s.now);
    }
    let v = t.flows.get(k)?;
    b.flows.insert(
        *k,
        Staged {
            seq: 0,
            now: v,
            before: Some(v.is_some()),
        },
    );
    Ok(v)
}

impl BpfFlowStore {
    fn service(&self, sh: &mut Shared, k: &ServiceKey) -> Result<Option<Service>> {
        if let Some(s) = sh.services.get(k) {
            return Ok(*s);
        }
        let s = self.services.get(k)?;
        sh.services.insert(*k, s);
        Ok(s)
    }

    fn nexthop(&self, sh: &mut Shared, a: &Addr) -> Result<Option<NextHop>> {
        if let Some(n) = sh.nexthops.get(a) {
            return Ok(*n);
        }
        let n = self.nexthops.get(a)?;
        sh.nexthops.insert(*a, n);
        Ok(n)
    }

    fn apply_connection<A: FlowAddr>(
        &self,
        t: &Tables<A>,
        b: &mut Batch<A>,
        sh: &mut Shared,
        ev: &FlowEvent<A>,
        seen: u64,
        now: u64,
    ) -> Result<ApplyOutcome> {
        let key = ev.key;
        if ev.fwd.flags & FLOW_F_FORWARD == 0 {
            anyhow::bail!("connection event without a forward entry");
        }
        let skey = ServiceKey {
            addr: key.dst.to_addr(),
            port_be: key.dport,
            proto: key.proto,
            family: A::FAMILY,
        };
        let Some(svc) = self.service(sh, &skey)? else {
            return Ok(ApplyOutcome::UnknownService);
        };
        let rkey = ev.fwd.partner_key(key.proto);
        let mut fwd = ev.fwd;
        let mut rev = ev.rev;
        // This machine's MAC of the backend's next hop. The interface slots stay the peer's: replicas forward on
        // the same interfaces in the same order, so the peer's choice (0 where client and backend share one) is
        // this machine's too.
        if let Some(nh) = self.nexthop(sh, &fwd.new_dst.to_addr())? {
            fwd.mac = nh.mac;
        }
        for e in [&mut fwd, &mut rev] {
            e.svc_id = svc.id;
            e.backend_id = SYNCED_BACKEND_ID;
            e.last_seen_ns = seen;
            e.flags |= FLOW_F_SYNCED;
        }
        let old_fwd = get(t, b, &key)?;
        let old_rev = get(t, b, &rkey)?;
        let same_fwd = old_fwd.is_some_and(|o| same_translation(&o, &fwd));
        let same_rev = old_rev.is_some_and(|o| same_translation(&o, &rev));
        if same_fwd && same_rev {
            // Known here: only move the ages forward (never backwards: local traffic is newer).
            for (k, o) in [(key, old_fwd), (rkey, old_rev)] {
                let mut o = o.expect("checked above");
                if o.last_seen_ns < seen {
                    o.last_seen_ns = seen;
                    b.write_flow(k, o);
                }
            }
            return Ok(ApplyOutcome::Unchanged);
        }
        if old_fwd.is_none() && ev.kind == FLOW_EV_REFRESH && closed_here(t, b, &key, &fwd)? {
            // A refresh taken before the connection closed, arriving after its close: it stays closed.
            return Ok(ApplyOutcome::Unchanged);
        }
        let carried =
            |o: Option<Flow<A>>, same: bool| o.is_some_and(|o| !same && carried_here(&o, now));
        let conflict = carried(old_fwd, same_fwd) || carried(old_rev, same_rev);
        if conflict && self.master.load(Ordering::Relaxed) {
            return Ok(ApplyOutcome::Conflict);
        }
        if let Some(o) = old_fwd.filter(|_| !same_fwd) {
            // The previous connection on this client port is over: its reverse entry (and SNAT port) goes.
            b.delete_flow(o.partner_key(key.proto));
        }
        if let Some(o) = old_rev.filter(|_| !same_rev) {
            // The SNAT port held another connection here: its forward entry goes with it, if it still is one.
            let okey = o.partner_key(key.proto);
            if okey != key && get(t, b, &okey)?.is_some_and(|f| f.partner_key(key.proto) == rkey) {
                b.delete_flow(okey);
            }
        }
        // Reverse first, like the data plane: a forward entry never points at a missing reverse one.
        b.write_flow(rkey, rev);
        b.write_flow(key, fwd);
        // A closed connection's entries under these keys in TRANSIENT_V4 (the peer's SYN removed them there) stay
        // until their closing timeout: FLOWS_V4 is looked up first, so nothing follows them, and looking for
        // them would cost two lookups per record.
        if key.proto == PROTO_TCP {
            sh.trusted.push(key.src.to_addr());
        }
        Ok(if conflict {
            ApplyOutcome::Conflict
        } else {
            ApplyOutcome::Applied
        })
    }
}

/// Whether the transient table holds the connection of forward entry `fwd` at `key` as closed.
fn closed_here<A: FlowAddr>(
    t: &Tables<A>,
    b: &mut Batch<A>,
    key: &FlowKey<A>,
    fwd: &Flow<A>,
) -> Result<bool> {
    let e = match b.transient.get(key) {
        Some(s) => s.now,
        None => t.transient.get(key)?,
    };
    Ok(e.is_some_and(|e| e.closed() && same_translation(&e.flow, fwd)))
}

/// A peer's close of one direction (`ev.key`, `ev.fwd`): recorded on the same connection here; when it ends
/// the connection, both entries move to the transient table as on the peer.
fn apply_close<A: FlowAddr>(
    t: &Tables<A>,
    b: &mut Batch<A>,
    ev: &FlowEvent<A>,
    seen: u64,
) -> Result<ApplyOutcome> {
    let bits = ev.fwd.flags & (FLOW_F_FIN | FLOW_F_RST);
    let Some(mut e) = get(t, b, &ev.key)? else {
        // Closed here already, or never synced.
        return Ok(ApplyOutcome::Unchanged);
    };
    if !same_translation(&e, &ev.fwd) || e.flags & bits == bits {
        // An earlier connection's close, after its successor's record; or known.
        return Ok(ApplyOutcome::Unchanged);
    }
    e.close(bits, seen);
    let pk = e.partner_key(ev.key.proto);
    let mut partner = get(t, b, &pk)?;
    if let Some(p) = partner.as_mut().filter(|_| bits & FLOW_F_RST != 0) {
        // A reset ends both directions (as the data plane records it).
        p.flags |= FLOW_F_RST;
        p.timeout_s = TCP_CLOSING_TIMEOUT_S;
    }
    if ev.key.proto == PROTO_TCP && (partner.is_none() || e.connection_closed(partner.as_ref())) {
        b.retire(ev.key, &e);
        if let Some(p) = partner {
            b.retire(pk, &p);
        }
    } else {
        b.write_flow(ev.key, e);
    }
    Ok(ApplyOutcome::Applied)
}

impl<A: FlowAddr> Batch<A> {
    fn next(&mut self) -> u64 {
        self.seq += 1;
        self.seq
    }

    fn write_flow(&mut self, k: FlowKey<A>, v: Flow<A>) {
        let seq = self.next();
        stage(&mut self.flows, k, Some(v), seq);
    }

    fn delete_flow(&mut self, k: FlowKey<A>) {
        let seq = self.next();
        stage(&mut self.flows, k, None, seq);
    }

    /// A closed connection's entry leaves the flow table for the transient one (the data plane's retire).
    fn retire(&mut self, k: FlowKey<A>, flow: &Flow<A>) {
        self.delete_flow(k);
        let seq = self.next();
        let t = Transient {
            flow: *flow,
            ..Default::default()
        };
        stage(&mut self.transient, k, Some(t), seq);
    }
}

fn stage<A: FlowAddr, V>(
    m: &mut StdMap<FlowKey<A>, Staged<V>>,
    k: FlowKey<A>,
    v: Option<V>,
    seq: u64,
) {
    let s = m.entry(k).or_insert(Staged {
        seq,
        now: None,
        before: None,
    });
    s.seq = seq;
    s.now = v;
}

/// A batch's changes to one table: the entries to write in the order of their last change, and the keys to
/// delete (those that may be in the map: a key looked up and missing needs no call).
#[allow(clippy::type_complexity)]
fn split<A: FlowAddr, V: Copy>(
    m: StdMap<FlowKey<A>, Staged<V>>,
) -> (Vec<(FlowKey<A>, V)>, Vec<FlowKey<A>>) {
    let mut changed: Vec<(FlowKey<A>, Staged<V>)> =
        m.into_iter().filter(|(_, s)| s.seq != 0).collect();
    changed.sort_unstable_by_key(|(_, s)| s.seq);
    let mut writes = Vec::new();
    let mut deletes = Vec::new();
    for (k, s) in changed {
        match s.now {
            Some(v) => writes.push((k, v)),
            None if s.before != Some(false) => deletes.push(k),
            None => {}
        }
    }
    (writes, deletes)
}

/// Whether this replica carries the connection of entry `e` itself: made or used by its own traffic (not a
/// synced copy), and neither closed nor idle. Only such an entry can conflict with a peer's record.
fn carried_here<A: FlowAddr>(e: &Flow<A>, now: u64) -> bool {
    e.flags & (FLOW_F_SYNCED | FLOW_F_FIN | FLOW_F_RST) == 0 && !e.idle(now)
}

/// Whether two entries rewrite packets the same way (ids, ages and marks aside).
fn same_translation<A: FlowAddr>(a: &Flow<A>, b: &Flow<A>) -> bool {
    (a.new_src, a.new_dst, a.new_sport, a.new_dport)
        == (b.new_src, b.new_dst, b.new_sport, b.new_dport)
}
