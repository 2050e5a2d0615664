//! The agent's IPv6 side against the real object's maps (loaded into the kernel; needs root): the programmer's
//! IPv6 services, backends, VIPs and source ranges, and the GC, flow filter, UDP flush and next-hop retargeting
//! over `FLOWS_V6`/`TRANSIENT_V6`. Entries are written straight into the maps: no packet is forwarded here.

use lb_agent::dataplane::gc::{self, now_ns};
use lb_agent::dataplane::model::{Protocol, ServiceId, ServiceSpec};
use lb_agent::dataplane::programmer::{ip_to_addr, service_key, Programmer};
use lb_agent::dataplane::{ConnectionLru, Dataplane, MapSizes};
use lb_common::{
    Addr, FlowKeyV4, FlowKeyV6, FlowV4, FlowV6, In6, TransientV6, FAMILY_V6, FLOW_F_END,
    FLOW_F_FIN, FLOW_F_FORWARD, FLOW_F_REVERSE, PROTO_TCP, PROTO_UDP, SVC_F_SOURCE_RANGES,
};
use std::collections::{BTreeSet, HashMap};
use std::net::{IpAddr, Ipv6Addr, SocketAddr};
use std::time::Duration;

fn sizes() -> MapSizes {
    MapSizes {
        connection_lru: ConnectionLru::PerCpu,
        flows: 1024,
        transient: 256,
        flows_v6: 1024,
        transient_v6: 256,
        services: 16,
        backends: 64,
        maglev_slots: 1 << 14,
        nexthops: 16,
        source_ranges: 64,
        trusted_sources: 64,
    }
}

fn load() -> Dataplane {
    Dataplane::load(&sizes(), None).expect("loading the data plane (root needed)")
}

fn raw(ip: &str) -> In6 {
    ip_to_addr(ip.parse().unwrap()).v6_raw()
}

const CLIENT: &str = "2001:db8:c::10";
const VIP: &str = "2001:db8:1::1";
const NODE: &str = "fd00::11";

fn spec(vip: &str, ranges: &[&str], backends: &[&str]) -> ServiceSpec {
    ServiceSpec {
        id: ServiceId {
            vip: vip.parse().unwrap(),
            port: 443,
            protocol: Protocol::Tcp,
        },
        snat: None,
        idle_timeout: Duration::from_secs(60),
        source_ranges: ranges.iter().map(|r| r.parse().unwrap()).collect(),
        backends: backends.iter().map(|b| b.parse().unwrap()).collect(),
        proxy_v2: false,
    }
}

/// A connection's two entries: client:cport → VIP:443 becomes VIP:sport → node:30443.
fn connection(proto: u8, cport: u16, seen: u64, timeout_s: u32) -> [(FlowKeyV6, FlowV6); 2] {
    let key = FlowKeyV6 {
        src: raw(CLIENT),
        dst: raw(VIP),
        sport: cport.to_be(),
        dport: 443u16.to_be(),
        proto,
        _pad: [0; 3],
    };
    let fwd = FlowV6 {
        new_src: raw(VIP),
        new_dst: raw(NODE),
        new_sport: (cport + 1000).to_be(),
        new_dport: 30443u16.to_be(),
        flags: FLOW_F_FORWARD,
        svc_id: 3,
        timeout_s,
        last_seen_ns: seen,
        ..Default::default()
    };
    let rev = FlowV6 {
        new_src: raw(VIP),
        new_dst: raw(CLIENT),
        new_sport: 443u16.to_be(),
        new_dport: cport.to_be(),
        flags: FLOW_F_REVERSE,
        svc_id: 3,
        timeout_s,
        last_seen_ns: seen,
        ..Default::default()
    };
    [(key, fwd), (fwd.partner_key(proto), rev)]
}

fn write(dp: &mut Dataplane, entries: &[(FlowKeyV6, FlowV6)]) {
    for (k, v) in entries {
        dp.maps.flows_v6.insert(k, v).unwrap();
        dp.maps.flow_filter.mark(k);
    }
}

#[test]
fn ipv6_services_backends_vips_and_ranges_are_written() {
    let mut dp = load();
    let mut p = Programmer::new(16, 64, 1 << 14);
    let v6 = spec(
        VIP,
        &["2001:db8:c::/48", "10.0.0.0/8"],
        &["[fd00::11]:30443"],
    );
    // An IPv4 service whose allow-list names only IPv6 ranges: on, with nothing to match (denies all).
    let v4_denied = spec("203.0.113.1", &["2001:db8:c::/48"], &["10.0.0.11:30443"]);
    p.apply(&mut dp.maps, &[v6.clone(), v4_denied.clone()])
        .unwrap();

    let key = service_key(&v6.id);
    assert_eq!(key.family, FAMILY_V6);
    let svc = dp.maps.services.get(&key).unwrap().expect("IPv6 service");
    assert_eq!(svc.flags & SVC_F_SOURCE_RANGES, SVC_F_SOURCE_RANGES);
    assert_eq!(
        svc.snat_addr,
        ip_to_addr(VIP.parse().unwrap()),
        "SNAT to the VIP"
    );
    let ids = dp.maps.maglev.read(svc.table_offset, 1).unwrap();
    let b = dp.maps.backends.get(ids[0]).unwrap();
    assert_eq!(
        (b.family, b.addr),
        (FAMILY_V6, ip_to_addr(NODE.parse().unwrap()))
    );
    assert_eq!(u16::from_be(b.port_be), 30443);
    assert!(dp
        .maps
        .vips
        .get(&ip_to_addr(VIP.parse().unwrap()))
        .unwrap()
        .is_some());
    let ranges = dp.maps.source_ranges.entries();
    let of = |id: u32| -> Vec<(Addr, u32)> {
        ranges
            .iter()
            .filter(|(s, _, _)| *s == id)
            .map(|(_, a, l)| (*a, *l))
            .collect()
    };
    assert_eq!(
        of(svc.id),
        vec![(ip_to_addr("2001:db8:c::".parse().unwrap()), 48)],
        "only the VIP's family's ranges"
    );
    let svc4 = dp
        .maps
        .services
        .get(&service_key(&v4_denied.id))
        .unwrap()
        .unwrap();
    assert_eq!(svc4.flags & SVC_F_SOURCE_RANGES, SVC_F_SOURCE_RANGES);
    assert!(
        of(svc4.id).is_empty(),
        "no IPv4 range: no IPv4 client matches"
    );

    // A restarted agent adopts the IPv6 service and VIP and converges without rewriting them.
    let mut adopted = Programmer::adopt(&mut dp.maps, 16, 64, 1 << 14).unwrap();
    adopted
        .apply(&mut dp.maps, std::slice::from_ref(&v6))
        .unwrap();
    assert!(dp
        .maps
        .vips
        .get(&ip_to_addr(VIP.parse().unwrap()))
        .unwrap()
        .is_some());
    assert!(dp
        .maps
        .services
        .get(&service_key(&v4_denied.id))
        .unwrap()
        .is_none());
    adopted.apply(&mut dp.maps, &[]).unwrap();
    assert!(dp.maps.vips.keys().unwrap().is_empty());
    assert!(dp.maps.source_ranges.entries().is_empty());
}

#[test]
fn the_gc_expires_idle_ipv6_connections_keeps_busy_ones_and_rebuilds_the_filter() {
    let mut dp = load();
    let now = now_ns();
    let idle = connection(PROTO_TCP, 40000, 1, 60);
    let busy = connection(PROTO_TCP, 40001, now, 60);
    write(&mut dp, &idle);
    write(&mut dp, &busy);
    // An IPv4 connection alongside: both families in one pass and one bitmap.
    let key4 = FlowKeyV4 {
        src: 1,
        dst: 2,
        sport: 10,
        dport: 80,
        proto: PROTO_TCP,
        _pad: [0; 3],
    };
    let fwd4 = FlowV4 {
        new_src: 2,
        new_dst: 3,
        new_sport: 5000,
        new_dport: 30080,
        flags: FLOW_F_FORWARD,
        svc_id: 1,
        timeout_s: 60,
        last_seen_ns: now,
        ..Default::default()
    };
    dp.maps.set_flow(&key4, &fwd4).unwrap();
    // A closed IPv6 connection lingering in the transient table, and a stale one.
    let [(ck, mut cf), _] = connection(PROTO_TCP, 40002, now, 10);
    cf.flags |= FLOW_F_FIN;
    let closed = TransientV6 {
        flow: cf,
        ..Default::default()
    };
    dp.maps.transient_v6.insert(&ck, &closed).unwrap();
    let [(sk, mut sf), _] = connection(PROTO_TCP, 40003, 1, 10);
    sf.flags |= FLOW_F_FIN;
    dp.maps
        .transient_v6
        .insert(
            &sk,
            &TransientV6 {
                flow: sf,
                ..Default::default()
            },
        )
        .unwrap();

    let r = gc::collect(&mut dp.maps, now, Some(10_000 * gc::NS_PER_MS)).unwrap();
    assert_eq!(r.expired.get(&3), Some(&1), "{r:?}");
    // The peers' refresh lists the busy connections of both families (the idle one is not recent).
    assert_eq!(
        r.refresh.len(),
        0,
        "the IPv4 entry has no reverse entry: no connection"
    );
    assert_eq!(r.refresh_v6.len(), 1);
    assert_eq!(r.refresh_v6[0].0.key, busy[0].0);
    assert_eq!(r.active.get(&3), Some(&1));
    assert_eq!(r.active.get(&1), Some(&1), "the IPv4 connection counts too");
    // By SNAT address: the IPv6 one translates to the VIP, the IPv4 one to its own.
    let vip: std::net::IpAddr = VIP.parse().unwrap();
    assert_eq!(
        r.active_by_snat.get(&vip),
        Some(&1),
        "{:?}",
        r.active_by_snat
    );
    assert_eq!(r.active_by_snat.values().sum::<u64>(), 2);
    assert_eq!((r.entries, r.entries_v6), (1, 2));
    assert_eq!(r.transient_entries_v6, 1);
    assert_eq!(
        r.deleted, 3,
        "the idle connection's two entries and the stale one"
    );
    let left: BTreeSet<u16> = dp
        .maps
        .flows_v6
        .keys()
        .unwrap()
        .iter()
        .filter(|k| k.src == raw(CLIENT))
        .map(|k| u16::from_be(k.sport))
        .collect();
    assert_eq!(left, BTreeSet::from([40001]));
    assert!(dp.maps.transient_v6.get(&sk).unwrap().is_none());

    // The rebuild marked what the walk found (the pass's deletions come after it: 7 keys), the next one what
    // is left: the busy connection's keys, the closed one's and the IPv4 one.
    assert_eq!(r.flow_filter_bits, Some(7), "{r:?}");
    let r = gc::collect(&mut dp.maps, now, None).unwrap();
    assert_eq!(r.flow_filter_bits, Some(4), "{r:?}");
    let f = &dp.maps.flow_filter;
    for (k, _) in &busy {
        assert!(f.may_hold(k));
    }
    assert!(f.may_hold(&ck) && f.may_hold(&key4));
    assert!(!f.may_hold(&idle[0].0) && !f.may_hold(&idle[1].0));
}

#[test]
fn ending_a_backends_flows_and_next_hop_changes_reach_ipv6_flows() {
    let mut dp = load();
    let now = now_ns();
    let udp = connection(PROTO_UDP, 5353, now, 60);
    let tcp = connection(PROTO_TCP, 40000, now, 60);
    write(&mut dp, &udp);
    write(&mut dp, &tcp);

    let mac = [2, 0, 0, 0, 0, 0x11];
    let nh = gc::NewNextHop {
        mac,
        egress: Some(2),
    };
    let changed: HashMap<Addr, gc::NewNextHop> = [(ip_to_addr(NODE.parse().unwrap()), nh)].into();
    let written = gc::retarget(&mut dp.maps.flows_v6, &changed).unwrap();
    assert_eq!(written.len(), 2, "the forward entries of both connections");
    let fwd = dp.maps.flows_v6.get(&tcp[0].0).unwrap().unwrap();
    assert_eq!((fwd.mac, fwd.egress), (mac, 2), "the new MAC and interface");
    let rev = dp.maps.flows_v6.get(&tcp[1].0).unwrap().unwrap();
    assert_eq!(
        (rev.mac, rev.egress),
        ([0; 6], 0),
        "reverse entries go to the client side"
    );

    let node = SocketAddr::new(IpAddr::V6(NODE.parse::<Ipv6Addr>().unwrap()), 30443);
    // The TCP backend stays healthy: only the UDP flow ends (a NodePort may serve both protocols).
    let dead: BTreeSet<(Protocol, SocketAddr)> = [(Protocol::Udp, node)].into();
    let ended = gc::end_flows(&mut dp.maps, &dead).unwrap();
    assert_eq!(ended.values().sum::<u64>(), 1);
    assert!(dp.maps.flows_v6.get(&udp[0].0).unwrap().is_none());
    assert!(dp.maps.flows_v6.get(&udp[1].0).unwrap().is_none());
    let fwd = dp.maps.flows_v6.get(&tcp[0].0).unwrap().unwrap();
    assert_eq!(fwd.flags & FLOW_F_END, 0, "the TCP connection stays");
    // Now the TCP backend fails too: its connection is marked for a reset, its entries stay until then.
    let dead: BTreeSet<(Protocol, SocketAddr)> = [(Protocol::Tcp, node)].into();
    assert_eq!(
        gc::end_flows(&mut dp.maps, &dead)
            .unwrap()
            .values()
            .sum::<u64>(),
        1
    );
    let fwd = dp.maps.flows_v6.get(&tcp[0].0).unwrap().unwrap();
    assert_eq!(fwd.flags & FLOW_F_END, FLOW_F_END);
    assert!(dp.maps.flows_v6.get(&tcp[1].0).unwrap().is_some());
    assert_eq!(
        gc::end_flows(&mut dp.maps, &dead)
            .unwrap()
            .values()
            .sum::<u64>(),
        0,
        "a marked connection is not counted twice"
    );
    assert_eq!(gc::flow_ip(raw(NODE)), NODE.parse::<IpAddr>().unwrap());
}

#[test]
fn a_narrowed_source_range_list_deletes_the_denied_clients_udp_flows_only() {
    let mut dp = load();
    let mut p = Programmer::new(16, 64, 1 << 14);
    let backends = ["[fd00::11]:30443"];
    let r = p
        .apply(&mut dp.maps, &[spec(VIP, &["2001:db8:c::/48"], &backends)])
        .unwrap();
    assert!(r.narrowed.is_empty(), "a new service has no flows to end");
    let r = p
        .apply(
            &mut dp.maps,
            &[spec(
                VIP,
                &["2001:db8:c::/48", "2001:db8:d::/48"],
                &backends,
            )],
        )
        .unwrap();
    assert!(r.narrowed.is_empty(), "a widened list denies no one new");
    let r = p
        .apply(&mut dp.maps, &[spec(VIP, &["2001:db8:d::/48"], &backends)])
        .unwrap();
    let [(id, allowed)] = &r.narrowed[..] else {
        panic!("{r:?}");
    };
    assert_eq!(allowed.len(), 1);

    let now = now_ns();
    let mut udp = connection(PROTO_UDP, 5353, now, 60);
    let mut tcp = connection(PROTO_TCP, 40000, now, 60);
    let mut other = connection(PROTO_UDP, 5354, now, 60);
    for e in udp.iter_mut().chain(tcp.iter_mut()) {
        e.1.svc_id = *id;
    }
    for e in other.iter_mut() {
        e.1.svc_id = id + 1;
    }
    for c in [&udp, &tcp, &other] {
        write(&mut dp, c);
    }
    let ended = gc::end_denied_udp(&mut dp.maps, &r.narrowed).unwrap();
    assert_eq!(ended, HashMap::from([(*id, 1)]));
    assert!(dp.maps.flows_v6.get(&udp[0].0).unwrap().is_none());
    assert!(dp.maps.flows_v6.get(&udp[1].0).unwrap().is_none());
    let fwd = dp.maps.flows_v6.get(&tcp[0].0).unwrap().unwrap();
    assert_eq!(fwd.flags & FLOW_F_END, 0, "TCP connections are kept");
    assert!(
        dp.maps.flows_v6.get(&other[0].0).unwrap().is_some(),
        "another service's flow stays"
    );
    // The client's own range allowed again, then narrowed to one that still holds it: nothing ends.
    write(&mut dp, &udp);
    let narrowed = [(*id, BTreeSet::from(["2001:db8::/32".parse().unwrap()]))];
    assert!(gc::end_denied_udp(&mut dp.maps, &narrowed)
        .unwrap()
        .is_empty());
    assert!(dp.maps.flows_v6.get(&udp[0].0).unwrap().is_some());
}

#[test]
fn lbctl_shows_ipv6_services_and_connections() {
    use lb_agent::report::inspect::{self, FlowFilter};
    let mut dp = load();
    let mut p = Programmer::new(16, 64, 1 << 14);
    p.apply(&mut dp.maps, &[spec(VIP, &[], &["[fd00::11]:30443"])])
        .unwrap();
    let id = p.service_indices().next().map(|(_, i)| i).unwrap();
    let mut conn = connection(PROTO_TCP, 40000, now_ns(), 60);
    for (_, f) in &mut conn {
        f.svc_id = id;
    }
    write(&mut dp, &conn);

    let services = inspect::services(&dp.maps).unwrap();
    assert_eq!(services.len(), 1);
    let s = &services[0];
    assert_eq!(s.vip, VIP.parse::<IpAddr>().unwrap());
    assert_eq!(s.snat_address, VIP.parse::<IpAddr>().unwrap());
    assert_eq!(s.backends.len(), 1);
    assert_eq!(s.backends[0].address, "[fd00::11]:30443".parse().unwrap());
    assert_eq!((s.backends[0].share, s.backends[0].active_flows), (1.0, 1));

    let flows = inspect::flows(&dp.maps, &FlowFilter::default()).unwrap();
    assert_eq!(flows.len(), 1);
    let c = &flows[0];
    assert_eq!(c.client, format!("[{CLIENT}]:40000").parse().unwrap());
    assert_eq!(c.service, format!("[{VIP}]:443").parse().unwrap());
    assert_eq!(c.snat, format!("[{VIP}]:41000").parse().unwrap());
    assert_eq!(c.backend, format!("[{NODE}]:30443").parse().unwrap());
    assert_eq!((c.state, c.table), ("established", "flows"));
    let only = FlowFilter {
        backend: Some(NODE.parse().unwrap()),
        ..Default::default()
    };
    assert_eq!(inspect::flows(&dp.maps, &only).unwrap().len(), 1);
    let elsewhere = FlowFilter {
        snat: Some(NODE.parse().unwrap()),
        ..Default::default()
    };
    assert!(inspect::flows(&dp.maps, &elsewhere).unwrap().is_empty());
    let own = FlowFilter {
        snat: Some(VIP.parse().unwrap()),
        ..Default::default()
    };
    assert_eq!(inspect::flows(&dp.maps, &own).unwrap().len(), 1);
}
