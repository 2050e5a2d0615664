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

use crate::dataplane::flow_filter::FlowFilterMap;
use crate::dataplane::gc::{connections, now_ns, NS_PER_MS};
use crate::dataplane::maps::{Maps, Table};
use crate::ha::sync::{ApplyOutcome, FlowRecord};
use anyhow::{Context, Result};
use lb_common::{
    Addr, FlowEventV4, FlowKeyV4, FlowV4, NextHop, Service, ServiceKey, TransientV4, FAMILY_V4,
    FLOW_EV_CLOSE, FLOW_EV_NEW, FLOW_EV_REFRESH, FLOW_F_FIN, FLOW_F_FORWARD, FLOW_F_RST,
    FLOW_F_SYNCED, PROTO_TCP, TCP_CLOSING_TIMEOUT_S,
};
use std::collections::HashMap as StdMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// Backend id of entries written by the sync (ids are per replica).
pub const SYNCED_BACKEND_ID: u32 = u32::MAX;

/// Handles on the data plane's maps, independent of the agent's [`Maps`].
pub struct BpfFlowStore {
    flows: Table<FlowKeyV4, FlowV4>,
    transient: Table<FlowKeyV4, TransientV4>,
    /// Marked for every connection written here, as the data plane marks its own (`lb_common::flow_filter`).
    filter: FlowFilterMap,
    services: Table<ServiceKey, Service>,
    nexthops: Table<Addr, NextHop>,
    /// The SYN rate guard's trusted sources: a peer's completed handshake vouches for its client here too, so
    /// after a failover the new master lets the old master's clients through a flood.
    trusted: Table<Addr, u8>,
    master: Arc<AtomicBool>,
}

/// What one batch of records changes, kept until the batch's end: the entries it wrote (`Some`) or deleted
/// (`None`) in each table, in the order of their last change, and what it read.
#[derive(Default)]
struct Batch {
    seq: u64,
    flows: StdMap<FlowKeyV4, Staged<FlowV4>>,
    transient: StdMap<FlowKeyV4, Staged<TransientV4>>,
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
            flows: maps.flows.reopen()?,
            transient: maps.transient.reopen()?,
            filter: maps.flow_filter.reopen().context("flow filter mapping")?,
            services: maps.services.reopen()?,
            nexthops: maps.nexthops.reopen()?,
            trusted: maps.trusted_sources.reopen()?,
            master,
        })
    }

    /// Every connection with both entries, as [`FLOW_EV_NEW`] events with their ages in ms.
    pub fn dump(&self) -> Result<Vec<(FlowEventV4, u32)>> {
        let flows: StdMap<FlowKeyV4, FlowV4> = self.flows.entries()?.into_iter().collect();
        Ok(connections(&flows, now_ns(), |_, _| true, FLOW_EV_NEW))
    }

    /// Applies a peer's event that happened `age_ms` ago.
    pub fn apply(&mut self, ev: &FlowEventV4, age_ms: u32) -> Result<ApplyOutcome> {
        let rec = FlowRecord { event: *ev, age_ms };
        Ok(self.apply_batch(&[rec])?[0])
    }

    /// Applies a batch of a peer's records in order; the maps see the batch's changes together at its end.
    pub fn apply_batch(&mut self, recs: &[FlowRecord]) -> Result<Vec<ApplyOutcome>> {
        let now = now_ns();
        let mut b = Batch::default();
        let mut out = Vec::with_capacity(recs.len());
        for r in recs {
            let seen = now.saturating_sub(r.age_ms as u64 * NS_PER_MS);
            let ev = &r.event;
            out.push(match ev.kind {
                FLOW_EV_NEW | FLOW_EV_REFRESH => self.apply_connection(&mut b, ev, seen, now)?,
                FLOW_EV_CLOSE => self.apply_close(&mut b, ev, seen)?,
                k => {
                    // The wire format checks kinds; a peer of a newer version could still send one we lack.
                    tracing::debug!(kind = k, "a synced record of an unknown kind");
                    ApplyOutcome::Error
                }
            });
        }
        self.commit(b)?;
        Ok(out)
    }

    /// Writes the batch's changes: flow entries (reverse before forward, as the records did), marked in the flow
    /// filter after the write (see `lb_common::flow_filter`), then deletions, then the transient table.
    fn commit(&mut self, b: Batch) -> Result<()> {
        let (writes, deletes) = split(b.flows);
        self.flows
            .insert_many(&writes)
            .context("writing synced flows")?;
        for (k, _) in &writes {
            self.filter.mark(k);
        }
        self.flows
            .remove_many(&deletes)
            .context("deleting replaced flows")?;
        let (writes, deletes) = split(b.transient);
        self.transient
            .insert_many(&writes)
            .context("writing closed connections")?;
        self.transient
            .remove_many(&deletes)
            .context("deleting closed connections")?;
        let mut trusted: Vec<(Addr, u8)> = b.trusted.into_iter().map(|a| (a, 1)).collect();
        trusted.sort_unstable_by_key(|(a, _)| a.bytes);
        trusted.dedup();
        self.trusted
            .insert_many(&trusted)
            .context("writing trusted sources")?;
        Ok(())
    }

    fn get(&self, b: &mut Batch, k: &FlowKeyV4) -> Result<Option<FlowV4>> {
        if let Some(s) = b.flows.get(k) {
            return Ok(s.now);
        }
        let v = self.flows.get(k)?;
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

    fn service(&self, b: &mut Batch, k: &ServiceKey) -> Result<Option<Service>> {
        if let Some(s) = b.services.get(k) {
            return Ok(*s);
        }
        let s = self.services.get(k)?;
        b.services.insert(*k, s);
        Ok(s)
    }

    fn nexthop(&self, b: &mut Batch, a: &Addr) -> Result<Option<NextHop>> {
        if let Some(n) = b.nexthops.get(a) {
            return Ok(*n);
        }
        let n = self.nexthops.get(a)?;
        b.nexthops.insert(*a, n);
        Ok(n)
    }

    fn apply_connection(
        &mut self,
        b: &mut Batch,
        ev: &FlowEventV4,
        seen: u64,
        now: u64,
    ) -> Result<ApplyOutcome> {
        let key = ev.key;
        if ev.fwd.flags & FLOW_F_FORWARD == 0 {
            anyhow::bail!("connection event without a forward entry");
        }
        let skey = ServiceKey {
            addr: Addr::from_v4_raw(key.dst),
            port_be: key.dport,
            proto: key.proto,
            family: FAMILY_V4,
        };
        let Some(svc) = self.service(b, &skey)? else {
            return Ok(ApplyOutcome::UnknownService);
        };
        let rkey = ev.fwd.partner_key(key.proto);
        let mut fwd = ev.fwd;
        let mut rev = ev.rev;
        if let Some(nh) = self.nexthop(b, &Addr::from_v4_raw(fwd.new_dst))? {
            fwd.mac = nh.mac;
        }
        for e in [&mut fwd, &mut rev] {
            e.svc_id = svc.id;
            e.backend_id = SYNCED_BACKEND_ID;
            e.last_seen_ns = seen;
            e.flags |= FLOW_F_SYNCED;
        }
        let old_fwd = self.get(b, &key)?;
        let old_rev = self.get(b, &rkey)?;
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
        if old_fwd.is_none() && ev.kind == FLOW_EV_REFRESH && self.closed_here(b, &key, &fwd)? {
            // A refresh taken before the connection closed, arriving after its close: it stays closed.
            return Ok(ApplyOutcome::Unchanged);
        }
        let carried =
            |o: Option<FlowV4>, same: bool| o.is_some_and(|o| !same && carried_here(&o, now));
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
            if okey != key
                && self
                    .get(b, &okey)?
                    .is_some_and(|f| f.partner_key(key.proto) == rkey)
            {
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
            b.trusted.push(Addr::from_v4_raw(key.src));
        }
        Ok(if conflict {
            ApplyOutcome::Conflict
        } else {
            ApplyOutcome::Applied
        })
    }

    /// Whether `TRANSIENT_V4` holds the connection of forward entry `fwd` at `key` as closed.
    fn closed_here(&self, b: &mut Batch, key: &FlowKeyV4, fwd: &FlowV4) -> Result<bool> {
        let t = match b.transient.get(key) {
            Some(s) => s.now,
            None => self.transient.get(key)?,
        };
        Ok(t.is_some_and(|t| t.closed() && same_translation(&t.flow, fwd)))
    }

    /// A peer's close of one direction (`ev.key`, `ev.fwd`): recorded on the same connection here; when it ends
    /// the connection, both entries move to `TRANSIENT_V4` as on the peer.
    fn apply_close(&mut self, b: &mut Batch, ev: &FlowEventV4, seen: u64) -> Result<ApplyOutcome> {
        let bits = ev.fwd.flags & (FLOW_F_FIN | FLOW_F_RST);
        let Some(mut e) = self.get(b, &ev.key)? else {
            // Closed here already, or never synced.
            return Ok(ApplyOutcome::Unchanged);
        };
        if !same_translation(&e, &ev.fwd) || e.flags & bits == bits {
            // An earlier connection's close, after its successor's record; or known.
            return Ok(ApplyOutcome::Unchanged);
        }
        e.close(bits, seen);
        let pk = e.partner_key(ev.key.proto);
        let mut partner = self.get(b, &pk)?;
        if let Some(p) = partner.as_mut().filter(|_| bits & FLOW_F_RST != 0) {
            // A reset ends both directions (as the data plane records it).
            p.flags |= FLOW_F_RST;
            p.timeout_s = TCP_CLOSING_TIMEOUT_S;
        }
        if ev.key.proto == PROTO_TCP && (partner.is_none() || e.connection_closed(partner.as_ref()))
        {
            b.retire(ev.key, &e);
            if let Some(p) = partner {
                b.retire(pk, &p);
            }
        } else {
            b.write_flow(ev.key, e);
        }
        Ok(ApplyOutcome::Applied)
    }
}

impl Batch {
    fn next(&mut self) -> u64 {
        self.seq += 1;
        self.seq
    }

    fn write_flow(&mut self, k: FlowKeyV4, v: FlowV4) {
        let seq = self.next();
        stage(&mut self.flows, k, Some(v), seq);
    }

    fn delete_flow(&mut self, k: FlowKeyV4) {
        let seq = self.next();
        stage(&mut self.flows, k, None, seq);
    }

    /// A closed connection's entry leaves the flow table for the transient one (the data plane's retire).
    fn retire(&mut self, k: FlowKeyV4, flow: &FlowV4) {
        self.delete_flow(k);
        let seq = self.next();
        let t = TransientV4 {
            flow: *flow,
            ..Default::default()
        };
        stage(&mut self.transient, k, Some(t), seq);
    }
}

fn stage<V>(m: &mut StdMap<FlowKeyV4, Staged<V>>, k: FlowKeyV4, v: Option<V>, seq: u64) {
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
fn split<V: Copy>(m: StdMap<FlowKeyV4, Staged<V>>) -> (Vec<(FlowKeyV4, V)>, Vec<FlowKeyV4>) {
    let mut changed: Vec<(FlowKeyV4, Staged<V>)> =
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
fn carried_here(e: &FlowV4, now: u64) -> bool {
    e.flags & (FLOW_F_SYNCED | FLOW_F_FIN | FLOW_F_RST) == 0 && !e.idle(now)
}

/// Whether two entries rewrite packets the same way (ids, ages and marks aside).
fn same_translation(a: &FlowV4, b: &FlowV4) -> bool {
    (a.new_src, a.new_dst, a.new_sport, a.new_dport)
        == (b.new_src, b.new_dst, b.new_sport, b.new_dport)
}
