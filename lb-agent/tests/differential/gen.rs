//! What the differential fuzzer sends: per epoch a scenario (services, settings), then a sequence of operations —
//! frames of real conversations over IPv4 and IPv6 (clients' SYNs, handshakes, data, FIN and RST, the backends'
//! answers to what was forwarded, UDP both ways, ICMP and ICMPv6 errors quoting flows), stray and hostile frames
//! (IPv6: neighbour discovery, extension headers, fragments, UDP without checksum), structured corruption of any of
//! them (truncation at every header boundary, IHL and length lies, options and extension headers, fragments, VLAN
//! tags, unknown EtherTypes and protocols, random bytes) and the clock advanced for a flow (its entries aged in
//! both the kernel and the model). Replies are built from the model's tables: the model knows where a flow was
//! sent. Conversations are written once, generic over the family ([`GenFam`]); only the frames' bytes differ.

use crate::common::{
    fix_ip_checksum, icmp_error, internet_checksum, node, node6, node_mac, pseudo_header, spec,
    spec_on, udp, CLIENT_MAC, LB_MAC, VIP, VIP6,
};
use crate::model::{Fam, Model};
use etherparse::PacketBuilder;
use lb_agent::dataplane::model::{Protocol, ServiceSpec};
use lb_common::{
    Config, Flow, FlowKey, In6, CFG_F_CHECK_DST_MAC, CFG_F_SYNC_EVENTS, FLOW_F_FORWARD,
    FLOW_F_REVERSE, FLOW_F_SYNCED, PROTO_ICMPV6, PROTO_TCP, PROTO_UDP,
};
use proptest::prelude::Rng;
use proptest::test_runner::{RngAlgorithm, TestRng};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::sync::OnceLock;
use std::time::Duration;

/// Clients: two inside the web service's source ranges (when it has some), one outside.
pub const CLIENTS: [Ipv4Addr; 3] = [
    Ipv4Addr::new(198, 51, 100, 10),
    Ipv4Addr::new(198, 51, 100, 11),
    Ipv4Addr::new(192, 0, 2, 7),
];
/// Two clients whose keys (TCP to the VIP's port 80) share a `HANDSHAKES` slot: each one's SYN points the slot at
/// its own handshake, and only the entry that is the client's own handshake counts (checked in `Gen::new`).
const COLLIDING: [(Ipv4Addr, u16); 2] = [
    (Ipv4Addr::new(198, 51, 100, 10), 40001),
    (Ipv4Addr::new(198, 51, 100, 12), 25833),
];
/// A second address of the load balancer, used as SNAT address by some scenarios.
pub const SNAT2: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 2);
/// IPv6 clients: two inside the IPv6 web service's source ranges (when it has some), one outside.
pub const CLIENTS6: [Ipv6Addr; 3] = [
    Ipv6Addr::new(0x2001, 0xdb8, 0x100, 0, 0, 0, 0, 0x10),
    Ipv6Addr::new(0x2001, 0xdb8, 0x100, 0, 0, 0, 0, 0x11),
    Ipv6Addr::new(0x2001, 0xdb8, 0x2, 0, 0, 0, 0, 0x7),
];
/// IPv6's `SNAT2`.
pub const SNAT6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0x113, 0, 0, 0, 0, 2);
/// Share of operations (%) on IPv6.
const IPV6_SHARE: u32 = 40;
/// Ports a client uses: few, so that connections on one port follow each other (reuse, reopen, expiry).
const CLIENT_PORTS: u16 = 12;
/// Node 5 has no next hop (the harness resolves nodes 1–4).
const NODES: u8 = 5;

/// One step of a sequence.
#[derive(Clone, Debug)]
pub enum Op {
    /// A frame through the program (and the model).
    Frame(Vec<u8>),
    /// An operation on IPv4's tables.
    V4(TableOp<u32>),
    /// An operation on IPv6's tables.
    V6(TableOp<In6>),
}

/// An operation on one family's flow tables, in the kernel and the model.
#[derive(Clone, Debug)]
pub enum TableOp<A> {
    /// The clock advanced for a flow: its entry in `FLOWS_V4` (or `TRANSIENT_V4`, or IPv6's) made idle since long.
    Age { key: FlowKey<A>, transient: bool },
    /// A connection made on an HA peer arrives by flow sync: both entries written into `FLOWS_V4` (`FLOWS_V6`) as
    /// the agent's flow store writes them, last seen `age_s` seconds ago.
    Synced {
        key: FlowKey<A>,
        fwd: Flow<A>,
        rev: Flow<A>,
        age_s: u64,
    },
}

/// A family's addresses in the scenarios, and its table operations.
pub trait GenFam: Fam {
    fn wrap(op: TableOp<Self>) -> Op;
    /// The VIP of the family's services.
    fn vip() -> IpAddr;
    fn clients() -> [IpAddr; 3];
    /// Two clients whose keys (TCP to the VIP's port 80) share a `HANDSHAKES` slot.
    fn colliding() -> [(IpAddr, u16); 2];
    fn node(i: u8) -> IpAddr;
    /// The second SNAT address.
    fn snat2() -> IpAddr;
    /// An address that is not the load balancer's.
    fn elsewhere() -> IpAddr;
    /// A router on the clients' side.
    fn router() -> IpAddr;
}

impl GenFam for u32 {
    fn wrap(op: TableOp<Self>) -> Op {
        Op::V4(op)
    }
    fn vip() -> IpAddr {
        VIP.into()
    }
    fn clients() -> [IpAddr; 3] {
        CLIENTS.map(IpAddr::V4)
    }
    fn colliding() -> [(IpAddr, u16); 2] {
        COLLIDING.map(|(a, p)| (a.into(), p))
    }
    fn node(i: u8) -> IpAddr {
        node(i).into()
    }
    fn snat2() -> IpAddr {
        SNAT2.into()
    }
    fn elsewhere() -> IpAddr {
        Ipv4Addr::new(10, 9, 9, 9).into()
    }
    fn router() -> IpAddr {
        Ipv4Addr::new(198, 51, 100, 1).into()
    }
}

impl GenFam for In6 {
    fn wrap(op: TableOp<Self>) -> Op {
        Op::V6(op)
    }
    fn vip() -> IpAddr {
        VIP6.into()
    }
    fn clients() -> [IpAddr; 3] {
        CLIENTS6.map(IpAddr::V6)
    }
    fn colliding() -> [(IpAddr, u16); 2] {
        *colliding6()
    }
    fn node(i: u8) -> IpAddr {
        node6(i).into()
    }
    fn snat2() -> IpAddr {
        SNAT6.into()
    }
    fn elsewhere() -> IpAddr {
        Ipv6Addr::new(0xfd00, 9, 9, 0, 0, 0, 0, 9).into()
    }
    fn router() -> IpAddr {
        Ipv6Addr::new(0x2001, 0xdb8, 0x100, 0, 0, 0, 0, 1).into()
    }
}

/// The client's key of a TCP connection to the VIP's port 80.
fn web_key<A: GenFam>(client: IpAddr, port: u16) -> FlowKey<A> {
    FlowKey {
        src: A::from_ip(client),
        dst: A::from_ip(A::vip()),
        sport: port.to_be(),
        dport: 80u16.to_be(),
        proto: PROTO_TCP,
        _pad: [0; 3],
    }
}

/// IPv6's colliding clients: the first IPv6 client's port 40001, and the first port of another client (searched
/// once) whose key falls into the same `HANDSHAKES_V6` slot.
fn colliding6() -> &'static [(IpAddr, u16); 2] {
    static PAIR: OnceLock<[(IpAddr, u16); 2]> = OnceLock::new();
    PAIR.get_or_init(|| {
        let first = (IpAddr::V6(CLIENTS6[0]), 40001);
        let slot = |(a, p)| lb_common::handshakes::slot(&web_key::<In6>(a, p));
        let target = slot(first);
        let second = (0x12..0x100)
            .flat_map(|host| {
                let a = Ipv6Addr::new(0x2001, 0xdb8, 0x100, 0, 0, 0, 0, host);
                (1024..=u16::MAX).map(move |p| (IpAddr::V6(a), p))
            })
            .find(|c| slot(*c) == target)
            .expect("a colliding IPv6 client");
        [first, second]
    })
}

/// An epoch's setup: what user space programs before the sequence runs.
#[derive(Clone, Debug)]
pub struct Scenario {
    pub specs: Vec<ServiceSpec>,
    pub cfg: Config,
}

pub struct Gen {
    rng: TestRng,
    /// Sequence numbers the backends used in their SYN-ACKs, by client, client port and service port (so that a
    /// client's ACK can match).
    isn: std::collections::HashMap<(IpAddr, u16, u16), u32>,
}

impl Gen {
    pub fn new(seed: u64) -> Self {
        let mut s = [0u8; 32];
        s[..8].copy_from_slice(&seed.to_le_bytes());
        let [a, b] =
            u32::colliding().map(|(c, p)| lb_common::handshakes::slot(&web_key::<u32>(c, p)));
        assert_eq!(a, b, "the colliding clients' HANDSHAKES slots");
        Gen {
            rng: TestRng::from_seed(RngAlgorithm::ChaCha, &s),
            isn: Default::default(),
        }
    }

    fn below(&mut self, n: u32) -> u32 {
        self.rng.next_u32() % n.max(1)
    }

    fn chance(&mut self, percent: u32) -> bool {
        self.below(100) < percent
    }

    fn pick<T: Copy>(&mut self, items: &[T]) -> T {
        items[self.below(items.len() as u32) as usize]
    }

    /// A new epoch's services and settings.
    pub fn scenario(&mut self) -> Scenario {
        self.isn.clear();
        let nodes = |g: &mut Gen, min: u32| -> Vec<u8> {
            let n = min + g.below(NODES as u32 - min + 1);
            let mut v: Vec<u8> = (1..=NODES).collect();
            for i in (1..v.len()).rev() {
                let j = g.below(i as u32 + 1) as usize;
                v.swap(i, j);
            }
            v.truncate(n as usize);
            v
        };
        let mut web = spec(Protocol::Tcp, 80, 30080, &nodes(self, 1));
        if self.chance(30) {
            web.source_ranges = vec!["198.51.100.0/28".parse().unwrap()];
        }
        if self.chance(20) {
            web.idle_timeout = Duration::ZERO;
        }
        let mut dns = spec(Protocol::Udp, 53, 30053, &nodes(self, 1));
        if self.chance(30) {
            dns.snat = Some(IpAddr::V4(SNAT2));
        }
        // A TCP service without a healthy backend, and a UDP one on the same port number as the web service.
        let empty = spec(Protocol::Tcp, 443, 30443, &[]);
        let udp80 = spec(Protocol::Udp, 80, 30081, &nodes(self, 0));
        // The same on the IPv6 VIP, to IPv6 backends.
        let vip6 = IpAddr::V6(VIP6);
        let mut web6 = spec_on(vip6, Protocol::Tcp, 80, 30080, &nodes(self, 1));
        if self.chance(30) {
            web6.source_ranges = vec!["2001:db8:100::/120".parse().unwrap()];
        }
        if self.chance(20) {
            web6.idle_timeout = Duration::ZERO;
        }
        let mut dns6 = spec_on(vip6, Protocol::Udp, 53, 30053, &nodes(self, 1));
        if self.chance(30) {
            dns6.snat = Some(IpAddr::V6(SNAT6));
        }
        let empty6 = spec_on(vip6, Protocol::Tcp, 443, 30443, &[]);
        let udp80_6 = spec_on(vip6, Protocol::Udp, 80, 30081, &nodes(self, 0));
        let mut cfg = Config {
            hash_seed: self.rng.next_u32(),
            ..Default::default()
        };
        match self.below(10) {
            // A narrow range that contains the service ports: they must be skipped.
            0..=2 => (cfg.snat_port_min, cfg.snat_port_max) = (40, 500),
            // A few ports only: new flows run out of them.
            3 => {
                cfg.snat_port_min = 1000;
                cfg.snat_port_max = 1000 + self.below(6) as u16;
            }
            _ => {}
        }
        if self.chance(50) {
            cfg.flags |= CFG_F_SYNC_EVENTS;
        }
        if self.chance(20) {
            // The SYN rate guard with a budget of one handshake per 4.3 s: within an epoch, every SYN after the
            // first handshake is over the rate.
            cfg.syn_interval_ns = u32::MAX;
            cfg.syn_burst_ns = 0;
        }
        if self.chance(30) {
            cfg.flags |= CFG_F_CHECK_DST_MAC;
            cfg.local_mac = LB_MAC;
        }
        Scenario {
            specs: vec![web, dns, empty, udp80, web6, dns6, empty6, udp80_6],
            cfg,
        }
    }

    /// The next operation, given what the model knows now.
    pub fn op(&mut self, model: &Model) -> Op {
        if self.chance(IPV6_SHARE) {
            self.op_in::<In6>(model)
        } else {
            self.op_in::<u32>(model)
        }
    }

    /// The next operation of family `A`.
    fn op_in<A: GenFam>(&mut self, model: &Model) -> Op {
        let (client, cport) = if self.chance(6) {
            self.pick(&A::colliding())
        } else {
            (
                self.pick(&A::clients()),
                40000 + self.below(CLIENT_PORTS as u32) as u16,
            )
        };
        let (proto, sport_svc): (u8, u16) = match self.below(10) {
            0..=5 => (PROTO_TCP, 80),
            6..=7 => (PROTO_UDP, 53),
            8 => (PROTO_TCP, 443),
            _ => (PROTO_UDP, 80),
        };
        let key = FlowKey::<A> {
            src: A::from_ip(client),
            dst: A::from_ip(A::vip()),
            sport: cport.to_be(),
            dport: sport_svc.to_be(),
            proto,
            _pad: [0; 3],
        };
        // The client's connection: established, closed, or a handshake (one entry under its reverse key, which
        // the backend answers even when another client's SYN took the slot the client finds it by).
        let conn = A::conn(&model.state);
        let handshake = conn.any_handshake(&key);
        let fwd = conn
            .flows
            .get(&key)
            .copied()
            .or_else(|| conn.transient.get(&key).map(|t| t.flow))
            .or_else(|| handshake.map(|(_, h)| h.fwd));
        if self.chance(4) {
            if let Some(f) = fwd {
                // Age one direction or the other (a handshake has one entry).
                let (k, transient) = if handshake.is_none() && self.chance(50) {
                    (key, !conn.flows.contains_key(&key))
                } else {
                    let pk = f.partner_key(proto);
                    (pk, !conn.flows.contains_key(&pk))
                };
                return A::wrap(TableOp::Age { key: k, transient });
            }
        }
        if fwd.is_none() && self.chance(3) {
            if let Some(op) = self.synced(model, key) {
                return A::wrap(op);
            }
        }
        let frame = match (self.below(100), fwd) {
            (0..=44, _) => self.client(client, cport, proto, sport_svc),
            (45..=79, Some(f)) => self.backend(client, cport, sport_svc, &f, proto),
            (80..=89, Some(f)) => self.icmp::<A>(client, cport, sport_svc, &f, proto),
            _ => self.stray::<A>(),
        };
        Op::Frame(match (self.chance(15), A::IP_LEN) {
            (false, _) => frame,
            (true, 20) => self.corrupt(frame),
            (true, _) => self.corrupt6(frame),
        })
    }

    /// A peer's connection for `key`: another backend choice, another SNAT port, the entries as sync writes them.
    fn synced<A: GenFam>(&mut self, model: &Model, key: FlowKey<A>) -> Option<TableOp<A>> {
        let svc = *model
            .tables
            .services
            .iter()
            .find(|(k, _)| {
                k.family == A::FAMILY
                    && A::from_addr(k.addr) == key.dst
                    && k.port_be == key.dport
                    && k.proto == key.proto
            })?
            .1;
        let node_i = 1 + self.below(NODES as u32) as u8;
        let node = A::from_ip(A::node(node_i));
        let node_port = (30000 + self.below(1000) as u16).to_be();
        let cfg = &model.tables.cfg;
        let port = (cfg.snat_port_min as u32
            + self.below((cfg.snat_port_max - cfg.snat_port_min) as u32 + 1))
            as u16;
        let port = port.to_be();
        let snat = A::from_addr(svc.snat_addr);
        let rkey = FlowKey {
            src: node,
            dst: snat,
            sport: node_port,
            dport: port,
            proto: key.proto,
            _pad: [0; 3],
        };
        let service_port = model.tables.services.keys().any(|k| {
            k.family == A::FAMILY
                && A::from_addr(k.addr) == snat
                && k.port_be == port
                && k.proto == key.proto
        });
        let conn = A::conn(&model.state);
        if service_port || conn.flows.contains_key(&rkey) || conn.transient.contains_key(&rkey) {
            return None;
        }
        let mac = model
            .tables
            .nexthops
            .get(&node.to_addr())
            .copied()
            .unwrap_or([0; 6]);
        // The stored sums are in the program's byte order (words as loaded from memory, little-endian here).
        let sum = |old: &[u16], new: &[u16]| crate::model::delta(old, new).swap_bytes() as u32;
        let w16 = u16::from_be;
        let entry = |new_src, new_dst, new_sport, new_dport, mac, flags| Flow {
            new_src,
            new_dst,
            new_sport,
            new_dport,
            mac,
            flags: flags | FLOW_F_SYNCED,
            egress: 0,
            svc_id: svc.id,
            backend_id: u32::MAX,
            timeout_s: svc.idle_timeout_s,
            csum_addr: 0,
            csum_port: 0,
            last_seen_ns: 0,
            ..Default::default()
        };
        let fwd = Flow {
            csum_addr: sum(
                &[key.src.words(), key.dst.words()].concat(),
                &[snat.words(), node.words()].concat(),
            ),
            csum_port: sum(
                &[w16(key.sport), w16(key.dport)],
                &[w16(port), w16(node_port)],
            ),
            ..entry(snat, node, port, node_port, mac, FLOW_F_FORWARD)
        };
        let rev = Flow {
            csum_addr: sum(
                &[node.words(), snat.words()].concat(),
                &[key.dst.words(), key.src.words()].concat(),
            ),
            csum_port: sum(
                &[w16(node_port), w16(port)],
                &[w16(key.dport), w16(key.sport)],
            ),
            ..entry(
                key.dst,
                key.src,
                key.dport,
                key.sport,
                CLIENT_MAC,
                FLOW_F_REVERSE,
            )
        };
        Some(TableOp::Synced {
            key,
            fwd,
            rev,
            age_s: self.pick(&[0, 0, 5]),
        })
    }

    /// The client's next segment or datagram to the VIP's port `port`.
    fn client(&mut self, client: IpAddr, cport: u16, proto: u8, port: u16) -> Vec<u8> {
        let payload = self.payload();
        let vip = match client {
            IpAddr::V4(_) => u32::vip(),
            IpAddr::V6(_) => In6::vip(),
        };
        if proto == PROTO_UDP {
            return udp(CLIENT_MAC, LB_MAC, client, cport, vip, port, &payload);
        }
        let isn = self.isn.get(&(client, cport, port)).copied().unwrap_or(0);
        let (flags, ack) = match self.below(12) {
            0..=3 => (SYN, 0),
            4..=6 => (ACK, isn.wrapping_add(1)),
            7 => (ACK, self.rng.next_u32()),
            8 => (ACK | PSH, isn.wrapping_add(1)),
            9 => (FIN | ACK, isn.wrapping_add(1)),
            10 => (RST, 0),
            _ => (self.below(256) as u8, self.rng.next_u32()),
        };
        let payload = if flags & SYN != 0 { vec![] } else { payload };
        tcp(
            CLIENT_MAC, LB_MAC, client, cport, vip, port, flags, 7000, ack, &payload,
        )
    }

    /// The backend answers what was forwarded for the client's flow whose forward entry is `f`.
    fn backend<A: GenFam>(
        &mut self,
        client: IpAddr,
        cport: u16,
        port: u16,
        f: &Flow<A>,
        proto: u8,
    ) -> Vec<u8> {
        let (src, dst) = (f.new_dst.ip(), f.new_src.ip());
        let (sport, dport) = (u16::from_be(f.new_dport), u16::from_be(f.new_sport));
        let mac = f.mac;
        let payload = self.payload();
        if proto == PROTO_UDP {
            return udp(mac, LB_MAC, src, sport, dst, dport, &payload);
        }
        let (flags, seq) = match self.below(10) {
            0..=3 => {
                let isn = self.rng.next_u32();
                self.isn.insert((client, cport, port), isn);
                (SYN | ACK, isn)
            }
            4..=5 => (
                ACK | PSH,
                self.isn
                    .get(&(client, cport, port))
                    .copied()
                    .unwrap_or(0)
                    .wrapping_add(1),
            ),
            6 => (FIN | ACK, 1),
            7 => (RST, 1),
            8 => (SYN, 1),
            _ => (self.below(256) as u8, self.rng.next_u32()),
        };
        let payload = if flags & SYN != 0 { vec![] } else { payload };
        tcp(
            mac, LB_MAC, src, sport, dst, dport, flags, seq, 7001, &payload,
        )
    }

    /// An ICMP (ICMPv6) error about a flow: from the backend's side about a forwarded packet, or from the client's
    /// side about a reply; sometimes of a type that is not an error (IPv6: echo, neighbour discovery), or quoting
    /// too little.
    fn icmp<A: GenFam>(
        &mut self,
        client: IpAddr,
        cport: u16,
        port: u16,
        f: &Flow<A>,
        proto: u8,
    ) -> Vec<u8> {
        let v6 = A::IP_LEN == 40;
        let ty = if v6 {
            self.pick(&[1u8, 1, 2, 3, 4, 128, 129, 135])
        } else {
            self.pick(&[3u8, 3, 11, 0, 8, 5])
        };
        let code = self.pick(&[0u8, 1, 3, 4]);
        let (mac, outer_src, outer_dst, inner) = if self.chance(50) {
            // The node (or a router before it) about the packet we sent it.
            let q = packet(
                f.new_src.ip(),
                u16::from_be(f.new_sport),
                f.new_dst.ip(),
                u16::from_be(f.new_dport),
                proto,
            );
            (f.mac, f.new_dst.ip(), f.new_src.ip(), q)
        } else {
            // A router on the client's side about a reply we sent the client.
            let q = packet(A::vip(), port, client, cport, proto);
            (CLIENT_MAC, A::router(), A::vip(), q)
        };
        let cut = match self.below(4) {
            0 => A::IP_LEN + self.below(8) as usize,
            1 => A::IP_LEN + 8,
            _ => inner.len(),
        };
        let mut inner = inner[..cut.min(inner.len())].to_vec();
        if v6 && self.chance(10) {
            // A quote whose transport header follows extension headers (or is another protocol's): the data plane
            // does not walk quoted extension headers.
            inner[6] = self.pick(&[0u8, 44, 58, 60]);
        }
        let inner = &inner[..];
        match (outer_src, outer_dst) {
            (IpAddr::V4(s), IpAddr::V4(d)) => {
                icmp_error(mac, LB_MAC, s, d, ty, code, [0, 0, 0x05, 0xdc], inner)
            }
            (IpAddr::V6(s), IpAddr::V6(d)) => {
                icmp6(mac, LB_MAC, s, d, ty, code, [0, 0, 0x05, 0x00], inner)
            }
            _ => unreachable!("one family"),
        }
    }

    /// Traffic that belongs to no flow: other ports, SNAT ports from anywhere, other addresses, other protocols;
    /// over IPv6 also neighbour discovery, echo, extension headers, fragments and datagrams without checksum.
    fn stray<A: GenFam>(&mut self) -> Vec<u8> {
        let node_i = 1 + self.below(NODES as u32) as u8;
        let flags = self.below(256) as u8;
        let port = self.below(65536) as u16;
        let [c0, c1, _] = A::clients();
        let vip = A::vip();
        let v6 = A::IP_LEN == 40;
        match self.below(if v6 { 9 } else { 6 }) {
            0 => tcp(CLIENT_MAC, LB_MAC, c0, 5555, vip, 22, SYN, 1, 0, b""),
            1 => tcp(
                node_mac(node_i),
                LB_MAC,
                A::node(node_i),
                30080,
                vip,
                port,
                flags,
                1,
                2,
                b"x",
            ),
            2 => udp(CLIENT_MAC, LB_MAC, c1, 5353, vip, port, b"q"),
            3 => tcp(
                CLIENT_MAC,
                LB_MAC,
                c0,
                6000,
                A::elsewhere(),
                80,
                SYN,
                1,
                0,
                b"",
            ),
            4 => udp(
                node_mac(node_i),
                LB_MAC,
                A::node(node_i),
                30053,
                A::snat2(),
                port,
                b"r",
            ),
            5 => {
                let len = self.below(120) as usize;
                let mut f: Vec<u8> = (0..len).map(|_| self.rng.next_u32() as u8).collect();
                if v6 && f.len() > 14 && self.chance(50) {
                    // An IPv6 EtherType, and often the version too.
                    f[12..14].copy_from_slice(&[0x86, 0xdd]);
                    f[0..6].copy_from_slice(&LB_MAC);
                    if f.len() > 14 && self.chance(70) {
                        f[14] = 0x60 | (f[14] & 0x0f);
                    }
                }
                f
            }
            6 => self.neighbour(),
            7 => {
                // A client's SYN or datagram behind extension headers, a fragment, a routing header.
                let cport = 40000 + self.below(CLIENT_PORTS as u32) as u16;
                let (proto, port) = self.pick(&[(PROTO_TCP, 80), (PROTO_UDP, 53)]);
                let frame = self.client(c0, cport, proto, port);
                self.extension(frame)
            }
            _ => {
                // A datagram without checksum, to a service or elsewhere.
                let dst = if self.chance(70) { vip } else { A::elsewhere() };
                let mut f = udp(
                    CLIENT_MAC,
                    LB_MAC,
                    self.pick(&A::clients()),
                    40000 + self.below(CLIENT_PORTS as u32) as u16,
                    dst,
                    self.pick(&[53, 80, 5353]),
                    b"no checksum",
                );
                f[54 + 6] = 0;
                f[54 + 7] = 0;
                f
            }
        }
    }

    /// Neighbour discovery, router messages and echo over ICMPv6.
    fn neighbour(&mut self) -> Vec<u8> {
        let link = Ipv6Addr::new(0xfe80, 0, 0, 0, 0, 0, 0, 1);
        let solicited = Ipv6Addr::new(0xff02, 0, 0, 0, 0, 1, 0xff00, 1);
        let (src, dst) = match self.below(3) {
            0 => (link, solicited),
            1 => (CLIENTS6[0], VIP6),
            _ => (link, VIP6),
        };
        let ty = self.pick(&[128u8, 129, 133, 134, 135, 136, 137]);
        let mut body = VIP6.octets().to_vec();
        if self.chance(50) {
            // A link-layer address option.
            body.extend_from_slice(&[1, 1]);
            body.extend_from_slice(&CLIENT_MAC);
        }
        icmp6(CLIENT_MAC, LB_MAC, src, dst, ty, 0, [0; 4], &body)
    }

    fn payload(&mut self) -> Vec<u8> {
        let n = self.pick(&[0usize, 0, 1, 5, 64]);
        (0..n).map(|_| self.rng.next_u32() as u8).collect()
    }

    /// IPv6 extension headers in front of an IPv6 frame's transport header: hop-by-hop and destination options
    /// (PadN; up to four, one more than the parser walks, some with a length past the packet), a routing header
    /// with or without segments left, a fragment header (first fragment or not), or an unwalked header.
    fn extension(&mut self, mut f: Vec<u8>) -> Vec<u8> {
        if f.len() < 54 {
            return f;
        }
        let mut nh = f[20];
        let mut headers = vec![];
        match self.below(6) {
            0..=2 => {
                for _ in 0..1 + self.below(4) {
                    let ty = self.pick(&[0u8, 60]);
                    let len = if self.chance(5) {
                        255
                    } else {
                        self.pick(&[0u8, 0, 1])
                    };
                    let mut h = vec![nh, len, 1, 4, 0, 0, 0, 0];
                    if len == 1 {
                        h.extend_from_slice(&[1, 6, 0, 0, 0, 0, 0, 0]);
                    }
                    headers.insert(0, h);
                    nh = ty;
                }
                // Hop-by-hop may only come first; the data plane walks whatever comes.
            }
            3 => {
                let segments = self.pick(&[0u8, 0, 1, 2]);
                headers.push(vec![
                    nh,
                    0,
                    self.pick(&[0u8, 2, 3, 4]),
                    segments,
                    0,
                    0,
                    0,
                    0,
                ]);
                nh = 43;
            }
            4 => {
                let frag = self.pick(&[0x0001u16, 0x0000, 0x0008, 0x0009]);
                let [a, b] = frag.to_be_bytes();
                headers.push(vec![nh, 0, a, b, 0, 0, 0x12, 0x34]);
                nh = 44;
            }
            _ => {
                let ty = self.pick(&[51u8, 50, 135, 59]);
                headers.push(vec![nh, 0, 0, 0, 0, 0, 0, 0]);
                nh = ty;
            }
        }
        let ext: Vec<u8> = headers.concat();
        let plen = u16::from_be_bytes([f[18], f[19]]) as usize + ext.len();
        f.splice(54..54, ext);
        f[18..20].copy_from_slice(&(plen as u16).to_be_bytes());
        f[20] = nh;
        f
    }

    /// One structured corruption of an IPv4 frame.
    fn corrupt(&mut self, mut f: Vec<u8>) -> Vec<u8> {
        let ihl = if f.len() > 14 {
            (f[14] & 0x0f) as usize * 4
        } else {
            20
        };
        let l4 = 14 + ihl;
        match self.below(16) {
            // Truncated at or near a header boundary.
            0 => {
                let at = self.pick(&[0usize, 13, 14, 20, 33, 34, l4 + 3, l4 + 7, l4 + 12, l4 + 19]);
                f.truncate(at.min(f.len()));
            }
            1 if f.len() > 14 => f[14] = (f[14] & 0xf0) | self.below(16) as u8,
            2 if f.len() > 17 => {
                let tot = self.pick(&[0u16, 19, 20, 21, 28, 40, (f.len() - 14) as u16 + 1, 1500]);
                f[16..18].copy_from_slice(&tot.to_be_bytes());
            }
            // IPv4 options (NOPs): the packet stays valid and must be forwarded with them.
            3 if f.len() >= 34 => {
                let words = 1 + self.below(3) as usize;
                let opts = vec![1u8; words * 4];
                f.splice(34..34, opts);
                f[14] = (f[14] & 0xf0) | (5 + words as u8);
                let tot = u16::from_be_bytes([f[16], f[17]]) + words as u16 * 4;
                f[16..18].copy_from_slice(&tot.to_be_bytes());
                fix_ip_checksum(&mut f);
            }
            4 if f.len() >= 34 => {
                let frag = self.pick(&[0x2000u16, 0x0001, 0x2010, 0x4000]);
                f[20..22].copy_from_slice(&frag.to_be_bytes());
            }
            5 if f.len() >= 14 => f.splice(12..12, [0x81, 0x00, 0x00, 0x05]).for_each(drop),
            6 if f.len() >= 14 => {
                let et = self.pick(&[0x86ddu16, 0x0806, 0x88cc, 0x0000]);
                f[12..14].copy_from_slice(&et.to_be_bytes());
            }
            7 if f.len() >= 34 => {
                f[23] = self.pick(&[0u8, 2, 47, 50, 132, 255]);
            }
            8 if f.len() > 14 + ihl + 12 => {
                f[l4 + 12] = (self.below(16) as u8) << 4;
            }
            9 if f.len() >= 6 => f[0..6].copy_from_slice(&node_mac(9)),
            // Ethernet padding after the IP packet.
            10 => f.extend((0..self.below(30)).map(|_| 0u8)),
            // A wrong checksum somewhere: the program must carry the error over, not fix or hide it.
            11 if f.len() > l4 + 18 => {
                let at = self.pick(&[24usize, 25, l4 + 6, l4 + 7, l4 + 16, l4 + 17]);
                f[at] ^= 1 + self.below(255) as u8;
            }
            12 if f.len() > 14 => f[14] = (self.below(16) as u8) << 4 | (f[14] & 0x0f),
            // A UDP datagram without checksum (0), which must stay without one.
            13 if f.len() >= l4 + 8 && f.get(23) == Some(&PROTO_UDP) => {
                f[l4 + 6] = 0;
                f[l4 + 7] = 0;
            }
            // TCP options (NOPs) in a longer header: a valid segment, rewritten like any other.
            14 if f.len() >= l4 + 20 && f.get(23) == Some(&PROTO_TCP) => {
                let words = 1 + self.below(3) as usize;
                f.splice(l4 + 20..l4 + 20, vec![1u8; words * 4]);
                f[l4 + 12] = ((5 + words as u8) << 4) | (f[l4 + 12] & 0x0f);
                let tot = u16::from_be_bytes([f[16], f[17]]) + words as u16 * 4;
                f[16..18].copy_from_slice(&tot.to_be_bytes());
                fix_ip_checksum(&mut f);
                fix_l4_checksum(&mut f);
            }
            _ => {
                for _ in 0..1 + self.below(4) {
                    if !f.is_empty() {
                        let at = self.below(f.len() as u32) as usize;
                        f[at] = self.rng.next_u32() as u8;
                    }
                }
            }
        }
        f
    }
    /// One structured corruption of an IPv6 frame.
    fn corrupt6(&mut self, mut f: Vec<u8>) -> Vec<u8> {
        let l4 = 54;
        let nh = f.get(20).copied();
        match self.below(17) {
            // Truncated at or near a header boundary.
            0 => {
                let at = self.pick(&[0usize, 13, 14, 20, 53, 54, 57, l4 + 7, l4 + 12, l4 + 19]);
                f.truncate(at.min(f.len()));
            }
            1 if f.len() > 14 => f[14] = (self.below(16) as u8) << 4 | (f[14] & 0x0f),
            // The payload length lies.
            2 if f.len() > 20 => {
                let plen = self.pick(&[
                    0u16,
                    7,
                    8,
                    19,
                    20,
                    f.len().saturating_sub(54) as u16 + 1,
                    f.len().saturating_sub(55) as u16,
                    1500,
                ]);
                f[18..20].copy_from_slice(&plen.to_be_bytes());
            }
            // Extension headers: the packet stays valid (up to three walked) and must be forwarded with them.
            3..=5 => f = self.extension(f),
            6 if f.len() >= 14 => f.splice(12..12, [0x81, 0x00, 0x00, 0x05]).for_each(drop),
            7 if f.len() >= 14 => {
                let et = self.pick(&[0x0800u16, 0x0806, 0x88cc, 0x0000]);
                f[12..14].copy_from_slice(&et.to_be_bytes());
            }
            8 if f.len() > 20 => {
                f[20] = self.pick(&[0u8, 2, 43, 44, 47, 50, 51, 58, 59, 60, 132, 135, 255]);
            }
            9 if f.len() > l4 + 12 && nh == Some(PROTO_TCP) => {
                f[l4 + 12] = (self.below(16) as u8) << 4;
            }
            10 if f.len() >= 6 => f[0..6].copy_from_slice(&node_mac(9)),
            // Ethernet padding after the IP packet.
            11 => f.extend((0..self.below(30)).map(|_| 0u8)),
            // A wrong checksum: the program must carry the error over, not fix or hide it.
            12 if f.len() > l4 + 18 => {
                let at = self.pick(&[l4 + 2, l4 + 3, l4 + 6, l4 + 7, l4 + 16, l4 + 17]);
                f[at] ^= 1 + self.below(255) as u8;
            }
            // A UDP datagram without checksum: dropped if it belongs to a flow or a service.
            13 if f.len() >= l4 + 8 && nh == Some(PROTO_UDP) => {
                f[l4 + 6] = 0;
                f[l4 + 7] = 0;
            }
            // TCP options (NOPs) in a longer header: a valid segment, rewritten like any other.
            14 if f.len() >= l4 + 20 && nh == Some(PROTO_TCP) => {
                let words = 1 + self.below(3) as usize;
                f.splice(l4 + 20..l4 + 20, vec![1u8; words * 4]);
                f[l4 + 12] = ((5 + words as u8) << 4) | (f[l4 + 12] & 0x0f);
                let plen = u16::from_be_bytes([f[18], f[19]]) + words as u16 * 4;
                f[18..20].copy_from_slice(&plen.to_be_bytes());
                fix_l4_checksum6(&mut f);
            }
            // An address bit flipped: another client, another VIP.
            15 if f.len() >= 54 => {
                let at = 22 + self.below(32) as usize;
                f[at] ^= 1 << self.below(8);
            }
            _ => {
                for _ in 0..1 + self.below(4) {
                    if !f.is_empty() {
                        let at = self.below(f.len() as u32) as usize;
                        f[at] = self.rng.next_u32() as u8;
                    }
                }
            }
        }
        f
    }
}

pub const FIN: u8 = 0x01;
pub const SYN: u8 = 0x02;
pub const RST: u8 = 0x04;
pub const PSH: u8 = 0x08;
pub const ACK: u8 = 0x10;

/// An Ethernet + IP + TCP frame with any flags, sequence and acknowledgement numbers; IPv4 or IPv6 as the
/// addresses are.
#[allow(clippy::too_many_arguments)]
fn tcp(
    src_mac: [u8; 6],
    dst_mac: [u8; 6],
    src: IpAddr,
    sport: u16,
    dst: IpAddr,
    dport: u16,
    flags: u8,
    seq: u32,
    ack: u32,
    payload: &[u8],
) -> Vec<u8> {
    let b = PacketBuilder::ethernet2(src_mac, dst_mac);
    let b = match (src, dst) {
        (IpAddr::V4(s), IpAddr::V4(d)) => b.ipv4(s.octets(), d.octets(), 64),
        (IpAddr::V6(s), IpAddr::V6(d)) => b.ipv6(s.octets(), d.octets(), 64),
        _ => unreachable!("one family"),
    };
    let mut b = b.tcp(sport, dport, seq, 65535);
    if flags & SYN != 0 {
        b = b.syn();
    }
    if flags & ACK != 0 {
        b = b.ack(ack);
    }
    if flags & FIN != 0 {
        b = b.fin();
    }
    if flags & RST != 0 {
        b = b.rst();
    }
    if flags & PSH != 0 {
        b = b.psh();
    }
    if flags & 0x20 != 0 {
        b = b.urg(0);
    }
    if flags & 0x40 != 0 {
        b = b.ece();
    }
    if flags & 0x80 != 0 {
        b = b.cwr();
    }
    let mut out = Vec::with_capacity(b.size(payload.len()));
    b.write(&mut out, payload).unwrap();
    out
}

/// An IP packet (no Ethernet) as it would be quoted in an ICMP error.
fn packet(src: IpAddr, sport: u16, dst: IpAddr, dport: u16, proto: u8) -> Vec<u8> {
    let b = match (src, dst) {
        (IpAddr::V4(s), IpAddr::V4(d)) => PacketBuilder::ipv4(s.octets(), d.octets(), 64),
        (IpAddr::V6(s), IpAddr::V6(d)) => PacketBuilder::ipv6(s.octets(), d.octets(), 64),
        _ => unreachable!("one family"),
    };
    let mut out = vec![];
    if proto == PROTO_TCP {
        let b = b.tcp(sport, dport, 1, 1000).syn();
        b.write(&mut out, &[]).unwrap();
    } else {
        let b = b.udp(sport, dport);
        b.write(&mut out, b"quoted").unwrap();
    }
    out
}

/// An Ethernet + IPv6 + ICMPv6 frame: type/code, `rest` = bytes 4..8 of the header (the MTU of "packet too big"),
/// then `body` (an error's quote), the checksum over the pseudo header and the message.
#[allow(clippy::too_many_arguments)]
fn icmp6(
    src_mac: [u8; 6],
    dst_mac: [u8; 6],
    src: Ipv6Addr,
    dst: Ipv6Addr,
    ty: u8,
    code: u8,
    rest: [u8; 4],
    body: &[u8],
) -> Vec<u8> {
    let mut m = vec![ty, code, 0, 0, rest[0], rest[1], rest[2], rest[3]];
    m.extend_from_slice(body);
    let ck = internet_checksum(&[&pseudo_header(src, dst, PROTO_ICMPV6, m.len()), &m]);
    m[2..4].copy_from_slice(&ck.to_be_bytes());
    let mut out = Vec::with_capacity(54 + m.len());
    out.extend_from_slice(&dst_mac);
    out.extend_from_slice(&src_mac);
    out.extend_from_slice(&[0x86, 0xdd, 0x60, 0, 0, 0]);
    out.extend_from_slice(&(m.len() as u16).to_be_bytes());
    out.extend_from_slice(&[PROTO_ICMPV6, 255]);
    out.extend_from_slice(&src.octets());
    out.extend_from_slice(&dst.octets());
    out.extend_from_slice(&m);
    out
}

/// Recomputes a TCP or UDP checksum over the pseudo header and the segment (as far as the IP total length says).
fn fix_l4_checksum(f: &mut [u8]) {
    let ihl = (f[14] & 0x0f) as usize * 4;
    let l4 = 14 + ihl;
    let end = (14 + u16::from_be_bytes([f[16], f[17]]) as usize).min(f.len());
    let at = l4 + if f[23] == PROTO_TCP { 16 } else { 6 };
    f[at] = 0;
    f[at + 1] = 0;
    let src = Ipv4Addr::new(f[26], f[27], f[28], f[29]);
    let dst = Ipv4Addr::new(f[30], f[31], f[32], f[33]);
    let ck = internet_checksum(&[&pseudo_header(src, dst, f[23], end - l4), &f[l4..end]]);
    f[at..at + 2].copy_from_slice(&ck.to_be_bytes());
}

/// IPv6's `fix_l4_checksum`, for a transport header right after the fixed header.
fn fix_l4_checksum6(f: &mut [u8]) {
    let l4 = 54;
    let end = (54 + u16::from_be_bytes([f[18], f[19]]) as usize).min(f.len());
    let at = l4 + if f[20] == PROTO_TCP { 16 } else { 6 };
    f[at] = 0;
    f[at + 1] = 0;
    let addr = |at: usize| Ipv6Addr::from(<[u8; 16]>::try_from(&f[at..at + 16]).unwrap());
    let (src, dst) = (addr(22), addr(38));
    let ck = internet_checksum(&[&pseudo_header(src, dst, f[20], end - l4), &f[l4..end]]);
    f[at..at + 2].copy_from_slice(&ck.to_be_bytes());
}
