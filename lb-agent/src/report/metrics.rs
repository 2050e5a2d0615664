//! Prometheus `/metrics`, `/healthz` and `/readyz`, rendered from the agent's latest [`Snapshot`], and the
//! yawol-named metric list written to `LoadBalancerMachine.status.metrics`.

use crate::dataplane::model::{Protocol, ServiceId};
use lb_common::ServiceStats;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, RwLock};

/// Per-service numbers.
#[derive(Clone, Debug, Default)]
pub struct ServiceMetrics {
    /// (VIP, port, protocol).
    pub id: Option<ServiceId>,
    /// Data-plane counters (summed over CPUs).
    pub stats: ServiceStats,
    /// Connections currently tracked and not idle-expired.
    pub active: u64,
    /// Connections expired for idleness since the agent started.
    pub idle_expired: u64,
    /// Connections the agent ended since it started because their backend failed its checks or left without
    /// draining (UDP flows moved, TCP connections marked for a reset).
    pub ended: u64,
}

/// Everything the endpoints show, replaced as a whole by the agent loop.
#[derive(Clone, Debug, Default)]
pub struct Snapshot {
    /// Services.
    pub services: Vec<ServiceMetrics>,
    /// Global data-plane counters by name.
    pub dataplane: Vec<(&'static str, u64)>,
    /// Backend health, per protocol (TCP and UDP backends may share an address).
    pub backends: Vec<(Protocol, SocketAddr, bool)>,
    /// Connection-tracking entries in use and the capacity.
    pub flow_entries: u64,
    /// Capacity of the connection-tracking map.
    pub flow_capacity: u64,
    /// The connection tables' LRU lists are per CPU (each CPU evicts within an even share of the capacity).
    pub flow_table_per_cpu_lists: bool,
    /// Entries of TCP handshakes and closed connections in use, and their capacity.
    pub transient_entries: u64,
    pub transient_capacity: u64,
    /// The same four for the IPv6 tables (`FLOWS_V6`, `TRANSIENT_V6`).
    pub flow_entries_v6: u64,
    pub flow_capacity_v6: u64,
    pub transient_entries_v6: u64,
    pub transient_capacity_v6: u64,
    /// Bits set in the flow filter after the last GC pass rebuilt it (of `2^lb_common::flow_filter::BITS_LOG2`).
    pub flow_filter_bits: u64,
    /// Host numbers (load1, memAvailable, …).
    pub host: BTreeMap<&'static str, f64>,
    /// Configurations applied successfully.
    pub config_applied: u64,
    /// Generation of the configuration in the maps (a config file's version counter, a LoadBalancer's
    /// `metadata.generation`).
    pub config_generation: u64,
    /// Configurations rejected.
    pub config_errors: u64,
    /// The data plane is attached and the first configuration is applied.
    pub ready: bool,
    /// The interfaces the data plane is attached to, with the hook on each.
    pub interfaces: Vec<(String, &'static str)>,
    /// Each attached interface's NIC as read at attach time, and whether native XDP transmits through the
    /// stack's queues under a lock ([`crate::dataplane::nic`]).
    pub nics: Vec<(String, crate::dataplane::nic::Nic, bool)>,
    /// Active-active: open connections translated to this replica's own SNAT address (`--snat-address`).
    pub own_connections: Option<u64>,
    /// VRRP and flow sync, when enabled.
    pub ha: Option<crate::ha::HaSnapshot>,
}

impl Snapshot {
    /// yawol's per-port metric list (`TCP-80-upstream_cx_active`, …) plus host metrics and, with
    /// `keepalived_stats`, keepalived's, for `LoadBalancerMachine.status.metrics`.
    pub fn yawol_metrics(&self, keepalived_stats: bool) -> Vec<(String, String)> {
        // One cluster per protocol and port, as yawol's Envoy has: a dual-stack port's IPv4 and IPv6 services
        // add up.
        let mut ports: Vec<(String, [u64; 6])> = Vec::new();
        for s in &self.services {
            let Some(id) = s.id else { continue };
            let p = format!("{}-{}", id.protocol.name(), id.port);
            let i = match ports.iter().position(|(q, _)| *q == p) {
                Some(i) => i,
                None => {
                    ports.push((p, [0; 6]));
                    ports.len() - 1
                }
            };
            let values = [
                s.active,
                s.stats.new_flows,
                connect_fail(&s.stats),
                s.stats.tx_bytes,
                s.stats.rx_bytes,
                s.idle_expired,
            ];
            for (sum, x) in ports[i].1.iter_mut().zip(values) {
                *sum += x;
            }
        }
        let mut v = Vec::new();
        for (p, values) in ports {
            for (name, x) in [
                "upstream_cx_active",
                "upstream_cx_total",
                "upstream_cx_connect_fail",
                "upstream_cx_rx_bytes_total",
                "upstream_cx_tx_bytes_total",
                "upstream_cx_idle_timeout",
            ]
            .into_iter()
            .zip(values)
            {
                v.push((format!("{p}-{name}"), x.to_string()));
            }
        }
        // yawol's own idle-timeout series: Envoy's `tcp.envoytcp.idle_timeout`, one stat prefix shared by every
        // TCP listener, so the sum over the TCP services (there whenever one exists).
        let tcp: Vec<&ServiceMetrics> = self
            .services
            .iter()
            .filter(|s| {
                s.id.is_some_and(|id| id.protocol == crate::dataplane::model::Protocol::Tcp)
            })
            .collect();
        if !tcp.is_empty() {
            let expired: u64 = tcp.iter().map(|s| s.idle_expired).sum();
            v.push(("envoytcp-idle_timeout".to_string(), expired.to_string()));
        }
        // yawol's names, units and text (loads and stealTime with two decimals).
        v.extend(crate::report::hostmetrics::yawol_metrics(&self.host));
        if let Some(n) = self.own_connections {
            v.push((
                lb_api::constants::machine_metrics::OWN_CONNECTIONS_ACTIVE.to_string(),
                n.to_string(),
            ));
        }
        let stats = self.ha.as_ref().and_then(|h| h.vrrp_stats.as_ref());
        if let Some(stats) = stats.filter(|_| keepalived_stats) {
            v.extend(stats.yawol_metrics());
        }
        v
    }
}

/// VRRP, active-active, BGP and sync families (only when HA is enabled).
fn encode_ha(enc: &mut DescriptorEncoder, h: &crate::ha::HaSnapshot) -> std::fmt::Result {
    let one = |v: u64| [(Vec::<(&'static str, String)>::new(), v)];
    if let Some(state) = h.vrrp_state {
        let states = ["init", "backup", "master", "fault", "stopped"];
        let rows: Vec<_> = states
            .iter()
            .map(|s| {
                (
                    vec![("state", s.to_string())],
                    u64::from(state.as_str() == *s),
                )
            })
            .collect();
        gauge(
            enc,
            "lb_vrrp_state",
            "1 for the machine's current VRRP state.",
            &rows,
        )?;
        gauge(
            enc,
            "lb_vrrp_eligible",
            "1 when the machine offers itself for the VIP (data plane attached, config current, flows synced).",
            &one(u64::from(h.eligible)),
        )?;
        counter(
            enc,
            "lb_keepalived_restarts",
            "keepalived processes restarted by the agent.",
            &one(h.keepalived_restarts),
        )?;
        if let Some(st) = &h.vrrp_stats {
            counter(
                enc,
                "lb_vrrp_became_master",
                "Times this machine became VRRP master.",
                &one(st.became_master),
            )?;
            counter(
                enc,
                "lb_vrrp_released_master",
                "Times this machine released VRRP master.",
                &one(st.released_master),
            )?;
            counter(
                enc,
                "lb_vrrp_adverts_sent",
                "VRRP advertisements sent.",
                &one(st.advertisements_sent),
            )?;
            counter(
                enc,
                "lb_vrrp_adverts_received",
                "VRRP advertisements received.",
                &one(st.advertisements_received),
            )?;
        }
    }
    if h.active_active {
        gauge(
            enc,
            "lb_vip_eligible",
            "1 when the machine should get the VIPs' traffic (active-active: data plane attached, config current, flows synced).",
            &one(u64::from(h.eligible)),
        )?;
    }
    if let Some(b) = &h.bgp {
        gauge(
            enc,
            "lb_bgp_eligible",
            "1 when the machine announces the VIPs (data plane attached, config current, flows synced).",
            &one(u64::from(h.eligible)),
        )?;
        gauge(
            enc,
            "lb_bgp_announced_vips",
            "VIPs in BIRD's announcement (they reach the routers whose session is established).",
            &one(b.announced.len() as u64),
        )?;
        let rows: Vec<_> = b
            .sessions
            .iter()
            .map(|s| (vec![("peer", s.peer.to_string())], u64::from(s.established)))
            .collect();
        gauge(
            enc,
            "lb_bgp_session_established",
            "1 for each router whose BGP session is established (as BIRD last said).",
            &rows,
        )?;
        counter(
            enc,
            "lb_bird_restarts",
            "BIRD processes restarted by the agent.",
            &one(b.restarts),
        )?;
    }
    if let Some(c) = &h.sync {
        counter(
            enc,
            "lb_sync_records_sent",
            "Flow records sent to peers.",
            &one(c.records_sent),
        )?;
        counter(
            enc,
            "lb_sync_records_received",
            "Flow records received from peers.",
            &one(c.records_received),
        )?;
        counter(
            enc,
            "lb_sync_records_applied",
            "Received records that changed the flow table.",
            &one(c.records_applied),
        )?;
        counter(
            enc,
            "lb_sync_records_unchanged",
            "Received records the flow table already had.",
            &one(c.records_unchanged),
        )?;
        let d = &c.dropped;
        let rows: Vec<_> = [
            ("auth", d.auth),
            ("decode", d.decode),
            ("conflict", d.conflict),
            ("unknown_service", d.unknown_service),
            ("queue_full", d.queue_full),
            ("store_error", d.store_error),
        ]
        .into_iter()
        .map(|(r, v)| (vec![("reason", r.to_string())], v))
        .collect();
        counter(
            enc,
            "lb_sync_records_dropped",
            "Records not applied or not sent, by reason.",
            &rows,
        )?;
        counter(
            enc,
            "lb_sync_conflicts",
            "Peer records for a connection this machine carries itself, translated differently: a split brain (0 otherwise).",
            &one(d.conflict),
        )?;
        counter(
            enc,
            "lb_sync_resyncs_sent",
            "Full flow-table dumps sent to peers.",
            &one(c.full_resyncs_sent),
        )?;
        counter(
            enc,
            "lb_sync_resyncs_received",
            "Full flow-table dumps received from peers.",
            &one(c.full_resyncs_received),
        )?;
        counter(
            enc,
            "lb_sync_frames_rejected",
            "Sync frames rejected (authentication, sequence, format).",
            &one(c.frames_rejected),
        )?;
        gauge(
            enc,
            "lb_sync_peers_connected",
            "Peers this machine sends its flows to.",
            &one(c.peers_connected),
        )?;
        gauge(
            enc,
            "lb_sync_synced",
            "1 once the flow table caught up with every reachable peer.",
            &one(u64::from(h.synced)),
        )?;
        gauge(
            enc,
            "lb_sync_apply_lag_ms",
            "Age of the last applied record when it was applied (ms).",
            &one(c.last_apply_lag_ms),
        )?;
    }
    Ok(())
}

/// New flows that could not be sent to a backend (Envoy's `upstream_cx_connect_fail` equivalent).
fn connect_fail(s: &ServiceStats) -> u64 {
    s.drop_no_backend + s.drop_snat_exhausted + s.pass_no_nexthop
}

/// Shared handle to the latest snapshot.
pub type SharedSnapshot = Arc<RwLock<Snapshot>>;

#[derive(Debug)]
struct SnapshotCollector(SharedSnapshot);

fn counter(
    enc: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    rows: &[(Vec<(&'static str, String)>, u64)],
) -> std::fmt::Result {
    let mut m = enc.encode_descriptor(name, help, None, MetricType::Counter)?;
    for (labels, v) in rows {
        ConstCounter::new(*v).encode(m.encode_family(labels)?)?;
    }
    Ok(())
}

fn gauge<T: prometheus_client::encoding::EncodeGaugeValue + Copy>(
    enc: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    rows: &[(Vec<(&'static str, String)>, T)],
) -> std::fmt::Result {
    let mut m = enc.encode_descriptor(name, help, None, MetricType::Gauge)?;
    for (labels, v) in rows {
        ConstGauge::new(*v).encode(m.encode_family(labels)?)?;
    }
    Ok(())
}

impl Collector for SnapshotCollector {
    fn encode(&self, mut enc: DescriptorEncoder) -> std::fmt::Result {
        let s = self.0.read().unwrap().clone();
        let svc = |f: &dyn Fn(&ServiceMetrics) -> u64| -> Vec<(Vec<(&'static str, String)>, u64)> {
            s.services
                .iter()
                .filter_map(|m| {
                    m.id.map(|id| {
                        (
                            vec![
                                ("protocol", id.protocol.name().to_string()),
                                ("port", id.port.to_string()),
                                ("vip", id.vip.to_string()),
                            ],
                            f(m),
                        )
                    })
                })
                .collect()
        };
        gauge(
            &mut enc,
            "lb_upstream_cx_active",
            "Connections tracked and not idle.",
            &svc(&|m| m.active),
        )?;
        counter(
            &mut enc,
            "lb_upstream_cx",
            "Connections established (TCP handshakes completed) and UDP flows created.",
            &svc(&|m| m.stats.new_flows),
        )?;
        counter(
            &mut enc,
            "lb_upstream_cx_connect_fail",
            "New flows that could not be sent to a backend (no healthy backend, SNAT ports exhausted, next hop unknown).",
            &svc(&|m| connect_fail(&m.stats)),
        )?;
        counter(
            &mut enc,
            "lb_upstream_cx_rx_bytes",
            "IP bytes received from backends.",
            &svc(&|m| m.stats.tx_bytes),
        )?;
        counter(
            &mut enc,
            "lb_upstream_cx_tx_bytes",
            "IP bytes sent to backends.",
            &svc(&|m| m.stats.rx_bytes),
        )?;
        counter(
            &mut enc,
            "lb_upstream_cx_idle_timeout",
            "Connections expired for idleness.",
            &svc(&|m| m.idle_expired),
        )?;
        counter(
            &mut enc,
            "lb_upstream_cx_ended_backend_gone",
            "Connections ended because their backend failed its checks or left without draining (UDP flows moved to a live backend, TCP connections marked: the client's next segment gets a reset).",
            &svc(&|m| m.ended),
        )?;
        counter(
            &mut enc,
            "lb_client_packets",
            "Packets client to backend.",
            &svc(&|m| m.stats.rx_packets),
        )?;
        counter(
            &mut enc,
            "lb_backend_packets",
            "Packets backend to client.",
            &svc(&|m| m.stats.tx_packets),
        )?;
        counter(
            &mut enc,
            "lb_closed_flows",
            "TCP flows that saw FIN or RST.",
            &svc(&|m| m.stats.closed_flows),
        )?;
        counter(
            &mut enc,
            "lb_drop_source_range",
            "New flows from outside the source ranges.",
            &svc(&|m| m.stats.drop_source_range),
        )?;
        counter(
            &mut enc,
            "lb_drop_no_flow",
            "TCP segments without a flow that were not a SYN.",
            &svc(&|m| m.stats.drop_no_flow),
        )?;
        counter(
            &mut enc,
            "lb_tcp_handshakes",
            "TCP handshakes started (client SYNs that opened a flow); established ones count in lb_upstream_cx.",
            &svc(&|m| m.stats.handshakes),
        )?;
        counter(
            &mut enc,
            "lb_drop_handshake",
            "Client segments that did not complete a handshake (an ACK not acknowledging the backend's SYN-ACK).",
            &svc(&|m| m.stats.drop_handshake),
        )?;
        counter(
            &mut enc,
            "lb_drop_syn_rate",
            "SYNs dropped by the new-handshake rate guard (over the rate, from a source that never completed a handshake).",
            &svc(&|m| m.stats.drop_syn_rate),
        )?;
        counter(
            &mut enc,
            "lb_reset_backend_gone",
            "Clients answered with a RST because their connection's backend failed its checks or left the service (not draining).",
            &svc(&|m| m.stats.reset_backend_gone),
        )?;
        counter(
            &mut enc,
            "lb_icmp_translated",
            "ICMP errors translated for this service's flows.",
            &svc(&|m| m.stats.icmp_translated),
        )?;
        let dp: Vec<_> = s
            .dataplane
            .iter()
            .map(|(n, v)| (vec![("reason", n.to_string())], *v))
            .collect();
        counter(
            &mut enc,
            "lb_dataplane_packets",
            "Data-plane decisions other than forwarding, by reason.",
            &dp,
        )?;
        let be: Vec<_> = s
            .backends
            .iter()
            .map(|(p, a, h)| {
                (
                    vec![
                        ("backend", a.to_string()),
                        ("protocol", p.name().to_string()),
                    ],
                    *h as i64,
                )
            })
            .collect();
        gauge(
            &mut enc,
            "lb_backend_healthy",
            "1 when the backend takes new flows.",
            &be,
        )?;
        gauge(
            &mut enc,
            "lb_flow_table_entries",
            "Connection-tracking entries in use (two per connection).",
            &[(vec![], s.flow_entries)],
        )?;
        gauge(
            &mut enc,
            "lb_flow_table_capacity",
            "Connection-tracking capacity (entries).",
            &[(vec![], s.flow_capacity)],
        )?;
        gauge(
            &mut enc,
            "lb_flow_table_per_cpu_lists",
            "1 where the connection tables' LRU lists are per CPU (--connection-lru): each CPU evicts within an \
             even share of the capacity.",
            &[(vec![], u64::from(s.flow_table_per_cpu_lists))],
        )?;
        gauge(
            &mut enc,
            "lb_transient_table_entries",
            "Entries of TCP handshakes and closed connections in use (two per connection).",
            &[(vec![], s.transient_entries)],
        )?;
        gauge(
            &mut enc,
            "lb_transient_table_capacity",
            "Capacity for TCP handshakes and closed connections (entries).",
            &[(vec![], s.transient_capacity)],
        )?;
        // IPv6's tables have their own capacities, so their own series (the IPv4 ones keep their names).
        gauge(
            &mut enc,
            "lb_flow_table_v6_entries",
            "IPv6 connection-tracking entries in use (two per connection).",
            &[(vec![], s.flow_entries_v6)],
        )?;
        gauge(
            &mut enc,
            "lb_flow_table_v6_capacity",
            "IPv6 connection-tracking capacity (entries).",
            &[(vec![], s.flow_capacity_v6)],
        )?;
        gauge(
            &mut enc,
            "lb_transient_table_v6_entries",
            "Entries of IPv6 TCP handshakes and closed connections in use (two per connection).",
            &[(vec![], s.transient_entries_v6)],
        )?;
        gauge(
            &mut enc,
            "lb_transient_table_v6_capacity",
            "Capacity for IPv6 TCP handshakes and closed connections (entries).",
            &[(vec![], s.transient_capacity_v6)],
        )?;
        gauge(
            &mut enc,
            "lb_flow_filter_bits_set",
            "Bits set in the flow filter after the last GC pass rebuilt it; over lb_flow_filter_bits, the share \
             of SNAT ports a new TCP connection skips as possibly held.",
            &[(vec![], s.flow_filter_bits)],
        )?;
        gauge(
            &mut enc,
            "lb_flow_filter_bits",
            "Bits of the flow filter (one generation).",
            &[(vec![], 1u64 << lb_common::flow_filter::BITS_LOG2)],
        )?;
        counter(
            &mut enc,
            "lb_config_applied",
            "Configurations applied.",
            &[(vec![], s.config_applied)],
        )?;
        counter(
            &mut enc,
            "lb_config_errors",
            "Configurations rejected.",
            &[(vec![], s.config_errors)],
        )?;
        gauge(
            &mut enc,
            "lb_config_generation",
            "Generation of the configuration in the maps.",
            &[(vec![], s.config_generation)],
        )?;
        let interfaces: Vec<_> = s
            .interfaces
            .iter()
            .map(|(i, m)| {
                (
                    vec![("interface", i.clone()), ("hook", m.to_string())],
                    1u64,
                )
            })
            .collect();
        gauge(
            &mut enc,
            "lb_interface_attached",
            "1 for each interface the data plane is attached to, with its hook.",
            &interfaces,
        )?;
        let queues: Vec<_> = s
            .nics
            .iter()
            .flat_map(|(i, n, _)| {
                [("rx", n.rx_queues), ("tx", n.tx_queues)].map(|(d, q)| {
                    (
                        vec![("interface", i.clone()), ("direction", d.to_string())],
                        q as u64,
                    )
                })
            })
            .collect();
        gauge(
            &mut enc,
            "lb_interface_queues",
            "Receive and transmit queues the network stack uses on each attached interface.",
            &queues,
        )?;
        let locked: Vec<_> = s
            .nics
            .iter()
            .map(|(i, _, l)| (vec![("interface", i.clone())], u64::from(*l)))
            .collect();
        gauge(
            &mut enc,
            "lb_interface_xdp_tx_locked",
            "1 where native XDP transmits (XDP_TX, XDP_REDIRECT) through the stack's queues under a lock: a \
             virtio-net NIC with fewer queue pairs than the stack's plus one per possible CPU.",
            &locked,
        )?;
        let host: Vec<_> = s
            .host
            .iter()
            .map(|(k, v)| (vec![("name", k.to_string())], *v))
            .collect();
        gauge(
            &mut enc,
            "lb_host",
            "Host metrics of the load-balancer VM (yawol's names).",
            &host,
        )?;
        if let Some(h) = &s.ha {
            encode_ha(&mut enc, h)?;
        }
        if let Some(n) = s.own_connections {
            gauge(
                &mut enc,
                "lb_own_connections_active",
                "Active-active: open connections translated to this replica's own address (only it can carry them).",
                &[(Vec::<(&'static str, String)>::new(), n)],
            )?;
        }
        Ok(())
    }
}

/// A registry rendering `snapshot` on every scrape.
pub fn registry(snapshot: SharedSnapshot) -> Registry {
    let mut r = Registry::default();
    r.register_collector(Box::new(SnapshotCollector(snapshot)));
    r
}

/// Serves `/metrics`, `/healthz` (process alive) and `/readyz` (attached and configured) on `addr`.
pub async fn serve(addr: SocketAddr, snapshot: SharedSnapshot) -> anyhow::Result<()> {
    use axum::{http::StatusCode, routing::get, Router};
    let reg = Arc::new(registry(snapshot.clone()));
    let app = Router::new()
        .route(
            "/metrics",
            get(move || {
                let reg = reg.clone();
                async move {
                    let mut body = String::new();
                    match prometheus_client::encoding::text::encode(&mut body, &reg) {
                        Ok(()) => (
                            StatusCode::OK,
                            [(
                                "content-type",
                                "application/openmetrics-text; version=1.0.0; charset=utf-8",
                            )],
                            body,
                        ),
                        Err(_) => (
                            StatusCode::INTERNAL_SERVER_ERROR,
                            [("content-type", "text/plain")],
                            "encoding failed".to_string(),
                        ),
                    }
                }
            }),
        )
        .route("/healthz", get(|| async { "ok" }))
        .route(
            "/readyz",
            get(move || {
                let s = snapshot.clone();
                async move {
                    if s.read().unwrap().ready {
                        (StatusCode::OK, "ready")
                    } else {
                        (StatusCode::SERVICE_UNAVAILABLE, "not ready")
                    }
                }
            }),
        );
    let listener = match tokio::net::TcpListener::bind(addr).await {
        // `[::]` stands for Go's `:PORT` (yawollet's flags); without IPv6 in the kernel Go takes 0.0.0.0 instead.
        Err(e)
            if addr.ip() == std::net::Ipv6Addr::UNSPECIFIED
                && e.raw_os_error() == Some(libc::EAFNOSUPPORT) =>
        {
            tokio::net::TcpListener::bind((std::net::Ipv4Addr::UNSPECIFIED, addr.port())).await
        }
        r => r,
    }
    .map_err(|e| anyhow::anyhow!("binding the metrics listener {addr}: {e}"))?;
    axum::serve(listener, app).await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dataplane::model::Protocol;

    fn render(snap: Snapshot) -> String {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &registry(Arc::new(RwLock::new(snap))))
            .unwrap();
        out
    }

    #[test]
    fn vip_eligible_only_when_active_active() {
        let ha = |active_active, eligible| Snapshot {
            ha: Some(crate::ha::HaSnapshot {
                active_active,
                eligible,
                ..Default::default()
            }),
            ..Default::default()
        };
        assert!(render(ha(true, true)).contains("lb_vip_eligible{} 1"));
        assert!(render(ha(true, false)).contains("lb_vip_eligible{} 0"));
        let vrrp = render(ha(false, true));
        assert!(!vrrp.contains("lb_vip_eligible"), "{vrrp}");
    }

    #[test]
    fn own_connections_only_when_active_active() {
        let snap = |own| Snapshot {
            own_connections: own,
            ..Default::default()
        };
        assert!(render(snap(Some(7))).contains("lb_own_connections_active{} 7"));
        assert!(snap(Some(7))
            .yawol_metrics(false)
            .contains(&("ownConnectionsActive".to_string(), "7".to_string())));
        assert!(!render(snap(None)).contains("lb_own_connections"));
        assert!(snap(None)
            .yawol_metrics(false)
            .iter()
            .all(|(k, _)| k != "ownConnectionsActive"));
    }

    #[test]
    fn renders_services_and_yawol_names() {
        let id = ServiceId {
            vip: "10.0.0.1".parse().unwrap(),
            port: 80,
            protocol: Protocol::Tcp,
        };
        let snap = Snapshot {
            services: vec![ServiceMetrics {
                id: Some(id),
                stats: ServiceStats {
                    new_flows: 7,
                    rx_bytes: 100,
                    tx_bytes: 200,
                    ..Default::default()
                },
                active: 3,
                idle_expired: 1,
                ended: 0,
            }],
            dataplane: vec![("drop_malformed", 2)],
            backends: vec![(Protocol::Tcp, "10.0.0.11:30080".parse().unwrap(), true)],
            ready: true,
            ..Default::default()
        };
        let names = snap.yawol_metrics(true);
        // yawollet's per-port names (Envoy cluster `TCP-80`'s counters) and its TCP idle-timeout series.
        for (name, value) in [
            ("TCP-80-upstream_cx_active", "3"),
            ("TCP-80-upstream_cx_total", "7"),
            ("TCP-80-upstream_cx_connect_fail", "0"),
            ("TCP-80-upstream_cx_rx_bytes_total", "200"),
            ("TCP-80-upstream_cx_tx_bytes_total", "100"),
            ("envoytcp-idle_timeout", "1"),
        ] {
            assert!(
                names.contains(&(name.to_string(), value.to_string())),
                "{name}={value} not in {names:?}"
            );
        }
        // keepalived's counters unless turned off (yawollet's `--keepalived-stats-file=""`).
        let with_vrrp = Snapshot {
            ha: Some(crate::ha::HaSnapshot {
                vrrp_stats: Some(crate::ha::vrrp::VrrpStats {
                    is_master: true,
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..snap.clone()
        };
        let master = ("keepalivedIsMaster".to_string(), "1".to_string());
        assert!(with_vrrp.yawol_metrics(true).contains(&master));
        assert_eq!(with_vrrp.yawol_metrics(false), names);
        // Dual stack: the IPv6 service of the same port adds to yawol's per-port series and has its own
        // `vip` label.
        let v6 = ServiceMetrics {
            id: Some(ServiceId {
                vip: "fd00::1".parse().unwrap(),
                ..id
            }),
            stats: ServiceStats {
                new_flows: 5,
                ..Default::default()
            },
            active: 2,
            idle_expired: 0,
            ended: 0,
        };
        let mut dual = snap.clone();
        dual.services.push(v6);
        dual.backends
            .push((Protocol::Tcp, "[fd00::11]:30080".parse().unwrap(), true));
        let dual_names = dual.yawol_metrics(false);
        for (name, value) in [
            ("TCP-80-upstream_cx_active", "5"),
            ("TCP-80-upstream_cx_total", "12"),
        ] {
            assert!(
                dual_names.contains(&(name.to_string(), value.to_string())),
                "{name}={value} not in {dual_names:?}"
            );
        }
        assert_eq!(dual_names.len(), names.len(), "no second TCP-80 cluster");
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &registry(Arc::new(RwLock::new(dual))))
            .unwrap();
        for line in [
            "lb_upstream_cx_active{protocol=\"TCP\",port=\"80\",vip=\"fd00::1\"} 2",
            "lb_backend_healthy{backend=\"[fd00::11]:30080\",protocol=\"TCP\"} 1",
            "lb_flow_table_v6_entries{} 0",
        ] {
            assert!(out.contains(line), "{line} not in {out}");
        }
        let reg = registry(Arc::new(RwLock::new(snap)));
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &reg).unwrap();
        assert!(
            out.contains("lb_upstream_cx_active{protocol=\"TCP\",port=\"80\",vip=\"10.0.0.1\"} 3"),
            "{out}"
        );
        assert!(
            out.contains("lb_upstream_cx_total{protocol=\"TCP\",port=\"80\",vip=\"10.0.0.1\"} 7"),
            "{out}"
        );
        assert!(
            out.contains("lb_dataplane_packets_total{reason=\"drop_malformed\"} 2"),
            "{out}"
        );
        assert!(
            out.contains("lb_backend_healthy{backend=\"10.0.0.11:30080\",protocol=\"TCP\"} 1"),
            "{out}"
        );
    }
}
