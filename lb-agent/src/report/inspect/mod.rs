//! Looking inside a load balancer, what `ipvsadm -Ln` and `conntrack -L` are to IPVS: the services with their
//! backends' shares and flows, the connection table with both directions as one connection, and the counters.
//! Everything is read from the maps the agent pins (`lbctl`, beside the agent), so it works while the agent is
//! down too — except [`trace`], which follows live packets.

pub mod trace;

use crate::dataplane::gc::flow_ip;
use crate::dataplane::programmer::addr_to_ip;
use crate::dataplane::Maps;
use anyhow::Result;
use lb_common::{
    stat, Flow, FlowAddr, FlowKey, ServiceStats, Transient, FAMILY_V4, FLOW_F_END, FLOW_F_FIN,
    FLOW_F_FORWARD, FLOW_F_RST, FLOW_F_SYNCED, FLOW_F_SYN_ACK, PROTO_TCP, PROTO_UDP,
    SVC_F_SOURCE_RANGES,
};
use serde::Serialize;
use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

/// A service as the data plane has it.
#[derive(Debug, Serialize)]
pub struct ServiceView {
    pub vip: IpAddr,
    pub port: u16,
    pub protocol: &'static str,
    pub id: u32,
    pub snat_address: IpAddr,
    /// Idle timeout of its flows, s (0 = never).
    pub idle_timeout_s: u32,
    pub source_ranges: bool,
    /// Backends taking new flows (healthy), and backends that only still carry flows (draining: unhealthy or
    /// removed; share 0).
    pub backends: Vec<BackendView>,
    /// The service's counters, summed over CPUs.
    pub counters: BTreeMap<&'static str, u64>,
}

/// A backend of a service.
#[derive(Debug, Serialize)]
pub struct BackendView {
    pub address: SocketAddr,
    /// Share of new flows: its part of the service's Maglev table.
    pub share: f64,
    /// Connections in the flow table going to it.
    pub active_flows: u64,
}

/// One connection: its forward entry and, when present, its reverse entry.
#[derive(Debug, Clone, Serialize)]
pub struct ConnectionView {
    pub protocol: &'static str,
    pub client: SocketAddr,
    /// VIP:port.
    pub service: SocketAddr,
    /// SNAT address:port towards the backend.
    pub snat: SocketAddr,
    /// Node:NodePort.
    pub backend: SocketAddr,
    pub state: &'static str,
    /// Seconds since either direction carried a packet.
    pub idle_s: f64,
    /// `flows` (established, UDP) or `transient` (handshake, closed).
    pub table: &'static str,
    /// Written by the flow sync from a peer and not used here since.
    pub synced: bool,
}

/// Selects connections (`None` = any).
#[derive(Debug, Default, Clone)]
pub struct FlowFilter {
    pub client: Option<IpAddr>,
    pub backend: Option<IpAddr>,
    /// Only connections translated to this source address (active-active: a replica's own connections).
    pub snat: Option<IpAddr>,
    pub service: Option<SocketAddr>,
    pub state: Option<String>,
}

impl FlowFilter {
    fn accepts(&self, c: &ConnectionView) -> bool {
        self.client.is_none_or(|a| a == c.client.ip())
            && self.backend.is_none_or(|a| a == c.backend.ip())
            && self.snat.is_none_or(|a| a == c.snat.ip())
            && self.service.is_none_or(|s| s == c.service)
            && self.state.as_deref().is_none_or(|s| s == c.state)
    }
}

fn protocol(p: u8) -> &'static str {
    match p {
        PROTO_TCP => "TCP",
        PROTO_UDP => "UDP",
        _ => "?",
    }
}

/// A flow table's address and port (both network order) as a socket address of its family.
fn sock<A: FlowAddr>(raw: A, port_be: u16) -> SocketAddr {
    SocketAddr::new(flow_ip(raw), u16::from_be(port_be))
}

/// Open connections per backend of service `svc_id` in one family's flow table.
fn count_active<A: FlowAddr>(
    flows: &[(FlowKey<A>, Flow<A>)],
    svc_id: u32,
    active: &mut BTreeMap<SocketAddr, u64>,
) {
    for (_, f) in flows
        .iter()
        .filter(|(_, f)| f.svc_id == svc_id && f.flags & FLOW_F_FORWARD != 0 && !closed(f))
    {
        *active.entry(sock(f.new_dst, f.new_dport)).or_default() += 1;
    }
}

/// The services, their backends and counters.
pub fn services(maps: &Maps) -> Result<Vec<ServiceView>> {
    let flows = maps.flows.entries()?;
    let flows_v6 = maps.flows_v6.entries()?;
    let mut out = Vec::new();
    for (key, svc) in maps.services.entries()? {
        let table = if svc.table_size > 0 {
            maps.maglev.read(svc.table_offset, svc.table_size)?
        } else {
            vec![]
        };
        // Shares by backend from the table; active flows by where they go (synced flows carry no local id).
        let mut share: BTreeMap<SocketAddr, u64> = BTreeMap::new();
        let mut ids: BTreeMap<u32, u64> = BTreeMap::new();
        for id in &table {
            *ids.entry(*id).or_default() += 1;
        }
        for (id, slots) in ids {
            let b = maps.backends.get(id)?;
            if b.family != 0 {
                let ip = addr_to_ip(&b.addr, b.family == FAMILY_V4);
                *share
                    .entry(SocketAddr::new(ip, u16::from_be(b.port_be)))
                    .or_default() += slots;
            }
        }
        let mut active: BTreeMap<SocketAddr, u64> = BTreeMap::new();
        count_active(&flows, svc.id, &mut active);
        count_active(&flows_v6, svc.id, &mut active);
        let mut views: Vec<BackendView> = share
            .keys()
            .chain(active.keys())
            .collect::<std::collections::BTreeSet<_>>()
            .into_iter()
            .map(|address| BackendView {
                address: *address,
                share: share.get(address).copied().unwrap_or(0) as f64 / table.len().max(1) as f64,
                active_flows: active.get(address).copied().unwrap_or(0),
            })
            .collect();
        views.sort_by_key(|b| b.address);
        out.push(ServiceView {
            vip: addr_to_ip(&key.addr, key.family == FAMILY_V4),
            port: u16::from_be(key.port_be),
            protocol: protocol(key.proto),
            id: svc.id,
            snat_address: addr_to_ip(&svc.snat_addr, key.family == FAMILY_V4),
            idle_timeout_s: svc.idle_timeout_s,
            source_ranges: svc.flags & SVC_F_SOURCE_RANGES != 0,
            backends: views,
            counters: service_counters(&maps.service_stats.total(svc.id)?),
        });
    }
    out.sort_by_key(|s| (s.vip, s.port, s.protocol));
    Ok(out)
}

/// A service's counters by name (the names of the per-service `lb_*` metrics, without the prefix).
pub fn service_counters(s: &ServiceStats) -> BTreeMap<&'static str, u64> {
    BTreeMap::from([
        ("rx_packets", s.rx_packets),
        ("rx_bytes", s.rx_bytes),
        ("tx_packets", s.tx_packets),
        ("tx_bytes", s.tx_bytes),
        ("handshakes", s.handshakes),
        ("new_flows", s.new_flows),
        ("closed_flows", s.closed_flows),
        ("drop_source_range", s.drop_source_range),
        ("drop_no_backend", s.drop_no_backend),
        ("drop_snat_exhausted", s.drop_snat_exhausted),
        ("drop_no_flow", s.drop_no_flow),
        ("drop_handshake", s.drop_handshake),
        ("drop_syn_rate", s.drop_syn_rate),
        ("reset_backend_gone", s.reset_backend_gone),
        ("pass_no_nexthop", s.pass_no_nexthop),
        ("icmp_translated", s.icmp_translated),
    ])
}

fn closed<A: FlowAddr>(f: &Flow<A>) -> bool {
    f.flags & (FLOW_F_FIN | FLOW_F_RST) != 0
}

/// The state of a connection from its two entries.
fn state<A: FlowAddr>(fwd: &Flow<A>, rev: Option<&Flow<A>>, transient: bool) -> &'static str {
    let flags = fwd.flags | rev.map_or(0, |r| r.flags);
    if flags & FLOW_F_RST != 0 {
        "reset"
    } else if fwd.flags & FLOW_F_END != 0 {
        // Its backend failed or left: the client's next segment gets a RST.
        "ending"
    } else if fwd.flags & FLOW_F_FIN != 0 && rev.is_some_and(|r| r.flags & FLOW_F_FIN != 0) {
        "closed"
    } else if flags & FLOW_F_FIN != 0 {
        "closing"
    } else if transient && flags & FLOW_F_SYN_ACK != 0 {
        "syn-ack"
    } else if transient {
        "syn"
    } else {
        "established"
    }
}

/// The connection table (both tables of both families), filtered, oldest-idle last.
pub fn flows(maps: &Maps, filter: &FlowFilter) -> Result<Vec<ConnectionView>> {
    let now = crate::dataplane::gc::now_ns();
    let mut out = Vec::new();
    connections(
        maps.flows.entries()?,
        maps.transient.entries()?,
        now,
        filter,
        &mut out,
    );
    connections(
        maps.flows_v6.entries()?,
        maps.transient_v6.entries()?,
        now,
        filter,
        &mut out,
    );
    out.sort_by(|a, b| a.idle_s.total_cmp(&b.idle_s));
    Ok(out)
}

/// One family's connections into `out`.
fn connections<A: FlowAddr>(
    established: Vec<(FlowKey<A>, Flow<A>)>,
    transient: Vec<(FlowKey<A>, Transient<A>)>,
    now: u64,
    filter: &FlowFilter,
    out: &mut Vec<ConnectionView>,
) {
    // A handshake is one entry holding both directions: shown like a closed connection's two.
    let transient: Vec<(FlowKey<A>, Flow<A>)> = transient
        .into_iter()
        .flat_map(|(k, t)| {
            let fwd = t.handshake().then(|| (t.flow.partner_key(k.proto), t.fwd));
            std::iter::once((k, t.flow)).chain(fwd)
        })
        .collect();
    for (table, entries) in [("flows", &established), ("transient", &transient)] {
        let by_key: std::collections::HashMap<_, _> = entries.iter().copied().collect();
        for (k, f) in entries
            .iter()
            .filter(|(_, f)| f.flags & FLOW_F_FORWARD != 0)
        {
            let rev = by_key.get(&f.partner_key(k.proto));
            let last = rev.map_or(f.last_seen_ns, |r| r.last_seen_ns.max(f.last_seen_ns));
            let c = ConnectionView {
                protocol: protocol(k.proto),
                client: sock(k.src, k.sport),
                service: sock(k.dst, k.dport),
                snat: sock(f.new_src, f.new_sport),
                backend: sock(f.new_dst, f.new_dport),
                state: state(f, rev, table == "transient"),
                idle_s: now.saturating_sub(last) as f64 / 1e9,
                table,
                synced: f.flags & FLOW_F_SYNCED != 0,
            };
            if filter.accepts(&c) {
                out.push(c);
            }
        }
    }
}

/// Connections by state.
pub fn count_by_state(flows: &[ConnectionView]) -> BTreeMap<&'static str, u64> {
    let mut m = BTreeMap::new();
    for c in flows {
        *m.entry(c.state).or_default() += 1;
    }
    m
}

/// A global counter (see `lb_common::stat`) and its rate over the interval.
#[derive(Debug, Serialize)]
pub struct CounterView {
    pub name: &'static str,
    pub value: u64,
    pub per_second: f64,
}

/// The data plane's global counters, read twice `interval` apart for their rates.
pub fn counters(maps: &Maps, interval: Duration) -> Result<Vec<CounterView>> {
    let before = maps.stats.totals()?;
    std::thread::sleep(interval);
    let after = maps.stats.totals()?;
    Ok((0..stat::COUNT as usize)
        .map(|i| CounterView {
            name: stat::NAMES[i],
            value: after[i],
            per_second: after[i].saturating_sub(before[i]) as f64
                / interval.as_secs_f64().max(1e-9),
        })
        .collect())
}
