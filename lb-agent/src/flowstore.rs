//! The connection-tracking table as the state sync sees it: full dumps for a (re)joining peer, and the
//! application of a peer's flow events to the local BPF maps.
//!
//! Replicas do not share ids or clocks, so an applied entry is translated: the service id is looked up by
//! (VIP, port, protocol) in the local `SERVICES` map, the next-hop MAC comes from the local `NEXTHOPS` map
//! when it knows the backend, and `last_seen_ns` is the local clock minus the age the peer sent. The backend
//! id of a synced entry is [`SYNCED_BACKEND_ID`] (it only labels flows; nothing routes by it).
//!
//! Conflicts (a peer translates a flow, or claims a SNAT port, differently from the local table) are counted
//! and resolved for the VRRP master: the master keeps its own entry, a backup takes the peer's. With the same
//! config and hash seed the replicas choose the same backend and SNAT port for a flow, so conflicts only
//! arise when configs differ for a moment or after a split brain.

use crate::dataplane::Dataplane;
use crate::flow_filter::FlowFilterMap;
use crate::gc::now_ns;
use anyhow::{Context, Result};
use aya::maps::{HashMap, MapData};
use lb_common::{
    map_names as names, Addr, FlowEvent, FlowKeyV4, FlowV4, NextHop, Service, ServiceKey,
    FAMILY_V4, FLOW_EV_CLOSE, FLOW_EV_NEW, FLOW_EV_REFRESH, FLOW_F_FIN, FLOW_F_FORWARD, FLOW_F_RST,
    FLOW_F_SYNCED, PROTO_TCP,
};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// Backend id of entries written by the sync (ids are per replica).
pub const SYNCED_BACKEND_ID: u32 = u32::MAX;

const NS_PER_MS: u64 = 1_000_000;

/// What applying one event did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Applied {
    /// Entries written.
    Written,
    /// Nothing to change (same translation; at most the age was refreshed).
    Unchanged,
    /// The local table translates the flow (or uses the SNAT port) differently; resolved as described above.
    Conflict,
    /// No local service for the flow's VIP and port (config not applied here yet, or different).
    UnknownService,
}

/// Handles on the pinned maps, independent of the agent's [`Dataplane`].
pub struct BpfFlowStore {
    flows: HashMap<MapData, FlowKeyV4, FlowV4>,
    /// Marked for every connection written here, as the data plane marks its own (`lb_common::flow_filter`).
    filter: FlowFilterMap,
    services: HashMap<MapData, ServiceKey, Service>,
    nexthops: HashMap<MapData, Addr, NextHop>,
    /// The SYN rate guard's trusted sources: a peer's completed handshake vouches for its client here too, so
    /// after a failover the new master lets the old master's clients through a flood.
    trusted: HashMap<MapData, Addr, u8>,
    master: Arc<AtomicBool>,
}

impl BpfFlowStore {
    /// Opens second handles on the flow, service and next-hop maps. `master` says whether this replica holds the
    /// VIP (it wins conflicts).
    pub fn open(dp: &mut Dataplane, master: Arc<AtomicBool>) -> Result<Self> {
        Ok(BpfFlowStore {
            flows: HashMap::try_from(dp.open_map(names::FLOWS_V4)?).context("flow map handle")?,
            filter: dp.open_flow_filter().context("flow filter mapping")?,
            services: HashMap::try_from(dp.open_map(names::SERVICES)?)
                .context("service map handle")?,
            nexthops: HashMap::try_from(dp.open_map(names::NEXTHOPS)?)
                .context("next-hop map handle")?,
            trusted: HashMap::try_from(dp.open_map(names::TRUSTED_SOURCES)?)
                .context("trusted-source map handle")?,
            master,
        })
    }

    /// Every connection with both entries, as [`FLOW_EV_NEW`] events with their ages in ms.
    pub fn dump(&self) -> Result<Vec<(FlowEvent, u32)>> {
        let flows: std::collections::HashMap<FlowKeyV4, FlowV4> =
            self.flows.iter().filter_map(|r| r.ok()).collect();
        Ok(connections(&flows, now_ns(), |_, _| true, FLOW_EV_NEW))
    }

    /// Applies a peer's event that happened `age_ms` ago.
    pub fn apply(&mut self, ev: &FlowEvent, age_ms: u32) -> Result<Applied> {
        let now = now_ns();
        let seen = now.saturating_sub(age_ms as u64 * NS_PER_MS);
        match ev.kind {
            FLOW_EV_NEW | FLOW_EV_REFRESH => self.apply_connection(ev, seen),
            FLOW_EV_CLOSE => self.apply_close(ev, seen),
            k => anyhow::bail!("unknown flow event kind {k}"),
        }
    }

    /// Writes an entry into `FLOWS_V4` and marks it in the flow filter (after the write: see
    /// `lb_common::flow_filter`).
    fn write(&mut self, k: FlowKeyV4, v: FlowV4) -> Result<()> {
        self.flows.insert(k, v, 0)?;
        self.filter.mark(&k);
        Ok(())
    }

    fn get(&self, k: &FlowKeyV4) -> Result<Option<FlowV4>> {
        match self.flows.get(k, 0) {
            Ok(v) => Ok(Some(v)),
            Err(aya::maps::MapError::KeyNotFound) => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    fn apply_connection(&mut self, ev: &FlowEvent, seen: u64) -> Result<Applied> {
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
        let svc = match self.services.get(&skey, 0) {
            Ok(s) => s,
            Err(aya::maps::MapError::KeyNotFound) => return Ok(Applied::UnknownService),
            Err(e) => return Err(e.into()),
        };
        let rkey = ev.fwd.partner_key(key.proto);
        let mut fwd = ev.fwd;
        let mut rev = ev.rev;
        if let Ok(nh) = self.nexthops.get(&Addr::from_v4_raw(fwd.new_dst), 0) {
            fwd.mac = nh.mac;
        }
        for e in [&mut fwd, &mut rev] {
            e.svc_id = svc.id;
            e.backend_id = SYNCED_BACKEND_ID;
            e.last_seen_ns = seen;
            e.flags |= FLOW_F_SYNCED;
        }
        let old_fwd = self.get(&key)?;
        let old_rev = self.get(&rkey)?;
        let same_fwd = old_fwd.is_some_and(|o| same_translation(&o, &fwd));
        let same_rev = old_rev.is_some_and(|o| same_translation(&o, &rev));
        if same_fwd && same_rev {
            // Known here: only move the ages forward (never backwards: local traffic is newer).
            for (k, o) in [(key, old_fwd), (rkey, old_rev)] {
                let mut o = o.expect("checked above");
                if o.last_seen_ns < seen {
                    o.last_seen_ns = seen;
                    self.write(k, o)?;
                }
            }
            return Ok(Applied::Unchanged);
        }
        let conflict = (old_fwd.is_some() && !same_fwd) || (old_rev.is_some() && !same_rev);
        if conflict && self.master.load(Ordering::Relaxed) {
            return Ok(Applied::Conflict);
        }
        if let Some(o) = old_fwd.filter(|_| !same_fwd) {
            // The old connection's reverse entry holds a SNAT port nobody uses any more.
            let _ = self.flows.remove(&o.partner_key(key.proto));
        }
        // Reverse first, like the data plane: a forward entry never points at a missing reverse one.
        self.write(rkey, rev)?;
        self.write(key, fwd)?;
        if key.proto == PROTO_TCP {
            self.trusted.insert(Addr::from_v4_raw(key.src), 1, 0)?;
        }
        Ok(if conflict {
            Applied::Conflict
        } else {
            Applied::Written
        })
    }

    fn apply_close(&mut self, ev: &FlowEvent, seen: u64) -> Result<Applied> {
        let bits = ev.fwd.flags & (FLOW_F_FIN | FLOW_F_RST);
        let Some(mut e) = self.get(&ev.key)? else {
            return Ok(Applied::Unchanged);
        };
        if e.flags & bits == bits {
            return Ok(Applied::Unchanged);
        }
        e.close(bits, seen);
        self.write(ev.key, e)?;
        if bits & FLOW_F_RST != 0 {
            let pk = e.partner_key(ev.key.proto);
            if let Some(mut p) = self.get(&pk)? {
                p.close(FLOW_F_RST, seen);
                self.write(pk, p)?;
            }
        }
        Ok(Applied::Written)
    }
}

/// Whether two entries rewrite packets the same way (ids, ages and marks aside).
fn same_translation(a: &FlowV4, b: &FlowV4) -> bool {
    (a.new_src, a.new_dst, a.new_sport, a.new_dport)
        == (b.new_src, b.new_dst, b.new_sport, b.new_dport)
}

/// Connections (forward entry + its reverse entry) of a table snapshot selected by `pick`, as events of `kind`
/// with the age of the younger entry.
pub fn connections(
    flows: &std::collections::HashMap<FlowKeyV4, FlowV4>,
    now: u64,
    pick: impl Fn(&FlowV4, &FlowV4) -> bool,
    kind: u8,
) -> Vec<(FlowEvent, u32)> {
    let mut out = Vec::new();
    for (k, f) in flows {
        if f.flags & FLOW_F_FORWARD == 0 {
            continue;
        }
        let Some(r) = flows.get(&f.partner_key(k.proto)) else {
            continue;
        };
        if !pick(f, r) {
            continue;
        }
        let last = f.last_seen_ns.max(r.last_seen_ns);
        let age_ms = (now.saturating_sub(last) / NS_PER_MS).min(u32::MAX as u64) as u32;
        out.push((
            FlowEvent {
                kind,
                _pad: [0; 7],
                key: *k,
                fwd: *f,
                rev: *r,
            },
            age_ms,
        ));
    }
    out
}

/// Connections this replica carried traffic for in the last `window_ns` (not just synced from a peer), for
/// the periodic refresh that keeps the peers' copies from idling out and repairs lost events.
pub fn refresh_events(
    flows: &std::collections::HashMap<FlowKeyV4, FlowV4>,
    now: u64,
    window_ns: u64,
) -> Vec<(FlowEvent, u32)> {
    let local_recent = |e: &FlowV4| {
        e.flags & FLOW_F_SYNCED == 0 && now.saturating_sub(e.last_seen_ns) <= window_ns
    };
    connections(
        flows,
        now,
        |f, r| local_recent(f) || local_recent(r),
        FLOW_EV_REFRESH,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(flags: u8, seen: u64, new: (u32, u32, u16, u16)) -> FlowV4 {
        FlowV4 {
            new_src: new.0,
            new_dst: new.1,
            new_sport: new.2,
            new_dport: new.3,
            flags,
            last_seen_ns: seen,
            ..Default::default()
        }
    }

    fn table(
        fwd_flags: u8,
        rev_flags: u8,
        seen: u64,
    ) -> std::collections::HashMap<FlowKeyV4, FlowV4> {
        let key = FlowKeyV4 {
            src: 1,
            dst: 2,
            sport: 10,
            dport: 80,
            proto: 6,
            _pad: [0; 3],
        };
        let fwd = entry(FLOW_F_FORWARD | fwd_flags, seen, (2, 3, 5000, 30080));
        let rev = entry(lb_common::FLOW_F_REVERSE | rev_flags, seen, (2, 1, 80, 10));
        [(key, fwd), (fwd.partner_key(6), rev)]
            .into_iter()
            .collect()
    }

    #[test]
    fn connections_pair_entries_and_report_ages() {
        let t = table(0, 0, 1_000 * NS_PER_MS);
        let c = connections(&t, 3_500 * NS_PER_MS, |_, _| true, FLOW_EV_NEW);
        assert_eq!(c.len(), 1);
        assert_eq!(c[0].1, 2_500);
        assert_eq!(
            c[0].0.rev.flags & lb_common::FLOW_F_REVERSE,
            lb_common::FLOW_F_REVERSE
        );
    }

    #[test]
    fn refresh_skips_idle_and_merely_synced_connections() {
        let now = 100_000 * NS_PER_MS;
        let window = 10_000 * NS_PER_MS;
        assert_eq!(
            refresh_events(&table(0, 0, now - NS_PER_MS), now, window).len(),
            1
        );
        assert!(refresh_events(&table(0, 0, now - 20_000 * NS_PER_MS), now, window).is_empty());
        let synced = table(FLOW_F_SYNCED, FLOW_F_SYNCED, now - NS_PER_MS);
        assert!(
            refresh_events(&synced, now, window).is_empty(),
            "no echo back to the peer"
        );
    }
}
