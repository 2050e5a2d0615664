//! Connection-tracking housekeeping: expires idle flows (the data plane only ignores them), counts active
//! connections and idle expiries per service, and watches the table's fill level.

use crate::dataplane::maps::Table;
use crate::dataplane::model::Protocol;
use crate::dataplane::programmer::addr_to_ip;
use crate::dataplane::Maps;
use anyhow::Result;
use ipnet::IpNet;
use lb_common::{
    Addr, Flow, FlowAddr, FlowEvent, FlowEventV4, FlowEventV6, FlowKey, FlowKeyV4, FlowV4,
    Transient, FAMILY_V4, FLOW_EV_REFRESH, FLOW_F_END, FLOW_F_FORWARD, FLOW_F_SYNCED, PROTO_TCP,
    PROTO_UDP,
};
use std::collections::{BTreeSet, HashMap, HashSet};
use std::net::{IpAddr, SocketAddr};

/// The clock of `bpf_ktime_get_coarse_ns` (CLOCK_MONOTONIC_COARSE), in ns.
pub fn now_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: valid pointer to a timespec.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC_COARSE, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// Result of one pass.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct GcReport {
    /// Active connections per service id (both families): not idle-expired, not reset, not closed by FIN in
    /// both directions.
    pub active: HashMap<u32, u64>,
    /// Active connections per SNAT address they are translated to (both families): an active-active replica's
    /// own ones are those of its own address, which only it can carry (their replies come back to it).
    pub active_by_snat: HashMap<IpAddr, u64>,
    /// Connections expired in this pass per service id (both families).
    pub expired: HashMap<u32, u64>,
    /// Entries left in `FLOWS_V4` after the pass.
    pub entries: u64,
    /// Entries left in `TRANSIENT_V4` (TCP handshakes and closed connections) after the pass.
    pub transient_entries: u64,
    /// Entries left in `FLOWS_V6` after the pass.
    pub entries_v6: u64,
    /// Entries left in `TRANSIENT_V6` after the pass.
    pub transient_entries_v6: u64,
    /// Bits set in the flow filter after this pass rebuilt it.
    pub flow_filter_bits: Option<u64>,
    /// Entries deleted (all four tables).
    pub deleted: u64,
    /// Connections this replica carried recently, for the peers' refresh (only when asked for): IPv4's.
    pub refresh: Vec<(FlowEventV4, u32)>,
    /// IPv6's `refresh`.
    pub refresh_v6: Vec<(FlowEventV6, u32)>,
}

/// One family's snapshot of its two tables, taken during the flow filter's rebuild.
struct Snapshot<A: FlowAddr> {
    flows: HashMap<FlowKey<A>, Flow<A>>,
    transient: Vec<(FlowKey<A>, Transient<A>)>,
}

impl<A: FlowAddr> Snapshot<A> {
    /// The keys the flow filter must hold: the flow table's and the closed connections' in the transient table.
    fn filter_keys(&self) -> impl Iterator<Item = &FlowKey<A>> {
        let closed = self
            .transient
            .iter()
            .filter(|(_, t)| !t.handshake())
            .map(|(k, _)| k);
        self.flows.keys().chain(closed)
    }
}

/// Walks the flow tables once (both families, same rules). A connection is expired when both of its entries
/// are idle past their timeouts (the rule the data plane applies); both entries are then deleted. Reverse
/// entries whose forward entry is gone (replaced by a new connection on the same client port, or evicted) go
/// when idle.
///
/// With `refresh_window_ns`, the same walk also lists the connections used here within that window
/// ([`refresh_events`], both families): state sync sends them so the peers' copies stay fresh.
pub fn collect(maps: &mut Maps, now: u64, refresh_window_ns: Option<u64>) -> Result<GcReport> {
    // The walk also rebuilds the flow filter (one bitmap for both families): cleared before it, marked with
    // what it finds after it. Both flow tables are walked before both transient tables, so a connection closing
    // during the walks (it moves from its flow table to its transient table) is seen by one of them (see
    // `lb_common::flow_filter`).
    maps.flow_filter.begin_rebuild();
    let flows_v4: HashMap<FlowKeyV4, FlowV4> = maps.flows.entries()?.into_iter().collect();
    let flows_v6 = maps.flows_v6.entries()?.into_iter().collect();
    let v4 = Snapshot {
        flows: flows_v4,
        transient: maps.transient.entries()?,
    };
    let v6 = Snapshot {
        flows: flows_v6,
        transient: maps.transient_v6.entries()?,
    };
    let flow_filter_bits = maps
        .flow_filter
        .finish_rebuild_both(v4.filter_keys(), v6.filter_keys());
    let mut r = GcReport {
        flow_filter_bits,
        refresh: refresh_window_ns
            .map(|w| refresh_events(&v4.flows, now, w))
            .unwrap_or_default(),
        refresh_v6: refresh_window_ns
            .map(|w| refresh_events(&v6.flows, now, w))
            .unwrap_or_default(),
        ..Default::default()
    };
    (r.entries, r.transient_entries) =
        expire(&v4, &mut maps.flows, &mut maps.transient, now, &mut r)?;
    (r.entries_v6, r.transient_entries_v6) =
        expire(&v6, &mut maps.flows_v6, &mut maps.transient_v6, now, &mut r)?;
    Ok(r)
}

/// One family's part of [`collect`]: deletes what expired, counts into `r`; returns the entries left in the
/// flow table and in the transient table.
fn expire<A: FlowAddr>(
    snap: &Snapshot<A>,
    flows_map: &mut Table<FlowKey<A>, Flow<A>>,
    transient_map: &mut Table<FlowKey<A>, Transient<A>>,
    now: u64,
    r: &mut GcReport,
) -> Result<(u64, u64)> {
    let flows = &snap.flows;
    let mut delete: Vec<FlowKey<A>> = Vec::new();
    let mut partnered: HashSet<FlowKey<A>> = HashSet::new();
    for (k, f) in flows {
        if f.flags & FLOW_F_FORWARD == 0 {
            continue;
        }
        let pk = f.partner_key(k.proto);
        let partner = flows.get(&pk);
        partnered.insert(pk);
        let expired = f.connection_idle(now, || partner);
        if expired {
            delete.push(*k);
            if partner.is_some() {
                delete.push(pk);
            }
            *r.expired.entry(f.svc_id).or_default() += 1;
        } else if !f.connection_closed(partner) {
            *r.active.entry(f.svc_id).or_default() += 1;
            *r.active_by_snat.entry(flow_ip(f.new_src)).or_default() += 1;
        }
    }
    for (k, f) in flows {
        if f.flags & FLOW_F_FORWARD == 0 && !partnered.contains(k) && f.idle(now) {
            delete.push(*k);
        }
    }
    flows_map.remove_many(&delete)?;
    let deleted = delete.len() as u64;
    // Handshakes that never completed and closed connections past their time: the data plane already ignores
    // them and the LRU would recycle them; deleting them keeps the table's fill level honest.
    let stale: Vec<FlowKey<A>> = snap
        .transient
        .iter()
        .filter(|(_, t)| t.stale(now))
        .map(|(k, _)| *k)
        .collect();
    transient_map.remove_many(&stale)?;
    let stale = stale.len() as u64;
    r.deleted += deleted + stale;
    Ok((
        (flows.len() as u64).saturating_sub(deleted),
        snap.transient.len() as u64 - stale,
    ))
}

/// The address of a flow-table address.
pub fn flow_ip<A: FlowAddr>(a: A) -> IpAddr {
    addr_to_ip(&a.to_addr(), A::FAMILY == FAMILY_V4)
}

/// Ends the connections (both families) that go to one of `backends` — (protocol, node:NodePort) pairs that
/// failed their checks or left the service without draining — and returns how many per service id. A UDP flow is
/// deleted, both entries: its next datagram picks a live backend (a UDP flow has no handshake to lose). A TCP
/// connection's forward entry is marked [`FLOW_F_END`]: once the backend has been silent on it for
/// [`lb_common::END_SILENCE_NS`], the data plane answers the client's next segment with a RST instead of
/// forwarding it into silence (the entries stay until then, or until they idle out).
pub fn end_flows(
    maps: &mut Maps,
    backends: &BTreeSet<(Protocol, SocketAddr)>,
) -> Result<HashMap<u32, u64>> {
    let mut ended = HashMap::new();
    if !backends.is_empty() {
        let to_gone = |p: Protocol, _: IpAddr, _: u32, to: SocketAddr| backends.contains(&(p, to));
        end_in(&mut maps.flows, &to_gone, &mut ended)?;
        end_in(&mut maps.flows_v6, &to_gone, &mut ended)?;
    }
    Ok(ended)
}

/// Deletes the UDP flows (both families) of services whose allow-list narrowed (`narrowed`: service id and the
/// ranges it allows now) whose client the list now denies, and returns how many per service id. A changed list
/// applies to new flows, and to a UDP client a reused source port is a new flow: without this, a datagram from
/// a port an earlier flow had used would pass the new list. TCP connections are kept until they close, as
/// kube-proxy and IPVS keep them.
pub fn end_denied_udp(
    maps: &mut Maps,
    narrowed: &[(u32, BTreeSet<IpNet>)],
) -> Result<HashMap<u32, u64>> {
    let mut ended = HashMap::new();
    if !narrowed.is_empty() {
        let allowed: HashMap<u32, &BTreeSet<IpNet>> =
            narrowed.iter().map(|(id, r)| (*id, r)).collect();
        let denied = |p: Protocol, client: IpAddr, svc: u32, _: SocketAddr| {
            p == Protocol::Udp
                && allowed
                    .get(&svc)
                    .is_some_and(|r| !r.iter().any(|n| n.contains(&client)))
        };
        end_in(&mut maps.flows, &denied, &mut ended)?;
        end_in(&mut maps.flows_v6, &denied, &mut ended)?;
    }
    Ok(ended)
}

/// Ends the connections of one family's flow table that `ends` picks by protocol, client address, service id and
/// backend: UDP flows are deleted, TCP connections marked [`FLOW_F_END`].
fn end_in<A: FlowAddr>(
    table: &mut Table<FlowKey<A>, Flow<A>>,
    ends: &dyn Fn(Protocol, IpAddr, u32, SocketAddr) -> bool,
    ended: &mut HashMap<u32, u64>,
) -> Result<()> {
    let (mut gone, mut marked) = (Vec::new(), Vec::new());
    for (k, mut f) in table.entries()? {
        if f.flags & (FLOW_F_FORWARD | FLOW_F_END) != FLOW_F_FORWARD {
            continue;
        }
        let protocol = match k.proto {
            PROTO_TCP => Protocol::Tcp,
            PROTO_UDP => Protocol::Udp,
            _ => continue,
        };
        let to = SocketAddr::new(flow_ip(f.new_dst), u16::from_be(f.new_dport));
        if !ends(protocol, flow_ip(k.src), f.svc_id, to) {
            continue;
        }
        if protocol == Protocol::Udp {
            gone.extend([k, f.partner_key(k.proto)]);
        } else {
            f.flags |= FLOW_F_END;
            marked.push((k, f));
        }
        *ended.entry(f.svc_id).or_default() += 1;
    }
    // A dead backend's connections can be many: spread where the lists are per CPU.
    table.insert_spread(&marked)?;
    table.remove_many(&gone)?;
    Ok(())
}

/// A backend's next hop that changed: its new MAC, and its new egress slot when its interface changed too.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NewNextHop {
    pub mac: [u8; 6],
    pub egress: Option<u8>,
}

/// Points the forward entries of connections to a backend whose next hop changed at its new MAC, and at its new
/// interface when that changed (`changed`: backend address → next hop), in one family's flow table; returns the
/// entries rewritten, which the caller marks in the flow filter. An entry whose interface did not change keeps
/// its slot (0 where client and backend share the interface: `XDP_TX`); the reverse entries keep the interface
/// their client came in by.
pub fn retarget<A: FlowAddr>(
    table: &mut Table<FlowKey<A>, Flow<A>>,
    changed: &HashMap<Addr, NewNextHop>,
) -> Result<Vec<FlowKey<A>>> {
    let mut written = Vec::new();
    for (k, mut f) in table.entries()? {
        if f.flags & FLOW_F_FORWARD != 0 {
            if let Some(nh) = changed.get(&f.new_dst.to_addr()) {
                f.mac = nh.mac;
                if let Some(egress) = nh.egress {
                    f.egress = egress;
                }
                written.push((k, f));
            }
        }
    }
    // Every connection through a next hop can be many: spread where the lists are per CPU.
    table.insert_spread(&written)?;
    Ok(written.into_iter().map(|(k, _)| k).collect())
}

/// Nanoseconds per millisecond (ages travel in ms, the data plane's clock is in ns).
pub const NS_PER_MS: u64 = 1_000_000;

/// Connections (forward entry + its reverse entry) of a table snapshot selected by `pick`, as events of `kind`
/// with the age of the younger entry.
pub fn connections<A: FlowAddr>(
    flows: &std::collections::HashMap<FlowKey<A>, Flow<A>>,
    now: u64,
    pick: impl Fn(&Flow<A>, &Flow<A>) -> bool,
    kind: u8,
) -> Vec<(FlowEvent<A>, u32)> {
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
pub fn refresh_events<A: FlowAddr>(
    flows: &std::collections::HashMap<FlowKey<A>, Flow<A>>,
    now: u64,
    window_ns: u64,
) -> Vec<(FlowEvent<A>, u32)> {
    let local_recent = |e: &Flow<A>| {
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
        let c = connections(&t, 3_500 * NS_PER_MS, |_, _| true, lb_common::FLOW_EV_NEW);
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
